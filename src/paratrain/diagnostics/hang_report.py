"""One report when a job hangs: for every rank, its state, the collective it is in, and its Python stacks.

When a collective times out (or ranks are found calling different collectives), the rank that noticed asks
every rank through the job's store; each rank's board thread answers within a beat with its Python stacks (every
thread), the collectives its monitor waits in and finished, and the latest collectives torch's Flight Recorder
saw. A rank that cannot answer is described by what can be known without it, never guessed: its heartbeat on the
board, and on the same machine the kernel's word on its process (stopped, gone) and, where it armed one, its
stacks through faulthandler's signal. The noticing rank prints the report and writes it as JSON::

    report = gather(board, by=0, seq=7, what="gradient all-reduce of bucket 0", timeout=10.0)
    print(report.render())
    report.write("paratrain-hang-report.json")

Answering runs on each rank's board thread (:class:`Answerer`), which keeps running while the main thread
sleeps, waits in a collective or loops in Python.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paratrain.diagnostics.board import Board
from paratrain.diagnostics.flight_recorder import recent
from paratrain.diagnostics.stacks import process_state, python_stacks, signal_dump, user_frame
from paratrain.files import atomic_writer

__all__ = ["ANSWERING_WAIT_S", "ANSWER_WAIT_S", "FRAMES_WAIT_S", "Answerer", "HangReport", "RankReport", "gather"]

ANSWER_WAIT_S = 4.0  # how long the noticing rank waits for the others' answers (they answer within a beat or two)
FRAMES_WAIT_S = 8.0  # more, when the answers carry the call sites of past collectives (torch symbolises them slowly)
# a rank that said it is answering is waited for up to this long: torch's first symbolisation of the call sites
# imports torch._inductor (about 4 s on an idle core, several times that on a loaded machine)
ANSWERING_WAIT_S = 40.0


@dataclass
class RankReport:
    """What is known of one rank when the report was gathered."""

    rank: int
    state: str  # "alive", "stopped", "gone", or what is known of one that did not answer
    answered: bool  # the rank answered from Python itself
    beating: bool = True  # its board's heartbeat moved while the report was gathered
    host: str | None = None
    pid: int | None = None
    waiting_in: str | None = None  # the collective it waits in, as its monitor knows it
    last_finished: str | None = None  # the last collective it finished
    launched: int = 0  # collectives its monitor launched
    waited_seconds: float = 0.0  # time it spent waiting in collectives so far
    user_line: str | None = None  # file:line of its main thread's innermost frame outside paratrain and torch
    stacks: list[dict[str, Any]] | None = None  # every thread, innermost frame last; None when unknown
    stacks_text: str | None = None  # the stacks as faulthandler wrote them (a rank that could not answer)
    stacks_file: str | None = None  # the file faulthandler wrote them to, on the rank's machine (kept after it)
    collectives: list[dict[str, Any]] = field(default_factory=list)  # its latest, from torch's Flight Recorder
    history: list[list[Any]] = field(default_factory=list)  # paratrain's latest: [its number, the group's, what]
    note: str = ""
    failed: int | None = None  # the collective it saw fail itself (it raised its own error, and may have left)

    @property
    def silent(self) -> bool:
        """No sign of life: it did not answer, its heartbeat stood still, and it never said it saw a failure."""
        return not self.answered and not self.beating and self.failed is None


@dataclass
class HangReport:
    """Every rank's state at the moment a collective timed out or ranks disagreed."""

    by: int  # the rank that noticed
    what: str  # what it noticed
    seq: int
    timeout: float | None
    time: float
    ranks: list[RankReport]
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        """The report as JSON at ``path``, atomically (see :mod:`paratrain.files`)."""
        target = Path(path)
        with atomic_writer(target, "w") as file:
            json.dump(self.as_dict(), file, indent=2, default=str)
            file.write("\n")
        self.path = str(target)
        return target

    def render(self) -> str:
        """A few lines per rank: what it is doing and where."""
        # the error printed after it says what went wrong, once: the heading only names the collective
        lines = [f"paratrain hang report (rank {self.by}), collective #{self.seq}: every rank's state"]
        for r in self.ranks:
            where = f" on {r.host} (pid {r.pid})" if r.host else ""
            lines.append(f"  rank {r.rank}{where}: {r.state}")
            if r.waiting_in:
                lines.append(f"    in {r.waiting_in}")
            elif r.answered:
                finished = f"; last finished {r.last_finished}" if r.last_finished else ""
                lines.append(f"    in no collective of paratrain's{finished}")
            if r.user_line:
                lines.append(f"    at {r.user_line}")
            if r.note:
                lines.append(f"    {r.note}")
            if r.stacks_file:
                lines.append(f"    its stacks, as faulthandler wrote them: {r.stacks_file}")
        if self.path:
            lines.append(f"  every thread's stack of every rank: {self.path}")
        return "\n".join(lines)


# -- answering: every rank, on its board's thread -------------------------------------------------------------------


class Answerer:
    """Answers the report requests of a board's namespace, once each, from the board's thread."""

    def __init__(self, board: Board, group: Any, status: Any) -> None:
        self.board = board
        self.group = group
        self.status = status  # the monitor's status(): what it waits in and finished
        self._answered: set[str] = set()

    def beat(self) -> None:
        """At every heartbeat: answer a new request, if one is there."""
        request = _read(self.board, f"{self.board.prefix}/request")
        if request is None or request["id"] in self._answered:
            return
        self._answered.add(request["id"])
        key = self.board.key(self.board.global_rank, "answer")
        self.board.store.set(key, json.dumps({"id": request["id"], "answering": True}))  # the asker waits on
        seqs = range(*request["seqs"]) if request.get("seqs") else None
        answer = answer_of(self.board, self.group, self.status(True), seqs)
        answer["id"] = request["id"]
        self.board.store.set(key, json.dumps(answer, default=str))


def answer_of(board: Board, group: Any, status: dict[str, Any], seqs: range | None = None) -> dict[str, Any]:
    """This rank's answer: its entry, its stacks, and its latest collectives; for the group's ``seqs``, with the
    call sites of each (which take torch a second or more to symbolise, so only when asked for)."""
    entry = board.entry()
    entry.update(status)
    entry["stacks"] = python_stacks()
    entry["collectives"] = [c.as_dict() for c in recent(group, 8, frames=seqs is not None, seqs=seqs)]
    return entry


def _read(board: Board, key: str) -> dict[str, Any] | None:
    try:
        if not board.store.check([key]):
            return None
        value: dict[str, Any] = json.loads(board.store.get(key).decode())
    except Exception:
        return None
    return value


# -- gathering: the rank that noticed -------------------------------------------------------------------------------


def gather(
    board: Board,
    group: Any,
    status: dict[str, Any],
    *,
    seq: int,
    what: str,
    timeout: float | None,
    seqs: range | None = None,
) -> HangReport:
    """Ask every rank, wait up to :data:`ANSWER_WAIT_S` for the answers (up to :data:`ANSWERING_WAIT_S` for a
    rank that said it is answering), and describe the rest.

    ``seqs``: the group's collectives every answer must show (with their call sites); default its latest.
    """
    request = {"id": uuid.uuid4().hex, "by": board.global_rank, "seq": seq, "what": what}
    if seqs is not None:
        request["seqs"] = [seqs.start, seqs.stop]
    before, read_at = board.read(), time.time()
    with contextlib.suppress(Exception):  # the store is gone: every other rank is described from what is left
        board.store.set(f"{board.prefix}/request", json.dumps(request))
    mine = answer_of(board, group, status, seqs)
    answers: dict[int, dict[str, Any]] = {board.global_rank: mine}
    # a rank whose board has not published for a few beats will not answer either: no waiting for it
    stale = read_at - 5 * board.interval  # as of the read: this rank's own answer may take seconds
    others = [r for r in board.global_ranks if r != board.global_rank and (before.get(r) or {}).get("time", 0) > stale]
    started = time.monotonic()
    deadline = started + (FRAMES_WAIT_S if seqs is not None else ANSWER_WAIT_S)
    answering: set[int] = set()  # ranks that took the request and are still putting their answer together

    def waiting() -> bool:
        now, left = time.monotonic(), [r for r in others if r not in answers]
        return bool(left) and (
            now < deadline or (now < started + ANSWERING_WAIT_S and bool(answering.intersection(left)))
        )

    while waiting():
        for rank in others:
            if rank not in answers:
                found = _read(board, board.key(rank, "answer"))
                if found is not None and found.get("id") == request["id"]:
                    if found.get("answering"):
                        answering.add(rank)
                    else:
                        answers[rank] = found
        time.sleep(0.1)
    after = board.read()
    ranks = []
    for rank in board.global_ranks:
        if rank in answers:
            ranks.append(_answered(rank, answers[rank]))
        else:
            ranks.append(_unanswered(rank, before.get(rank), after.get(rank), mine["host"]))
    return HangReport(board.global_rank, what, seq, timeout, time.time(), ranks)


def _answered(rank: int, answer: dict[str, Any]) -> RankReport:
    main = next((s for s in answer.get("stacks", []) if s.get("thread") == "MainThread"), None)
    frame = user_frame(main["frames"]) if main else None
    waiting = answer.get("in")
    finished = answer.get("done")
    return RankReport(
        rank=rank,
        state="alive",
        answered=True,
        host=answer.get("host"),
        pid=answer.get("pid"),
        waiting_in=f"collective #{waiting[0]}: {waiting[1]} (for {waiting[2]:.1f} s)" if waiting else None,
        last_finished=f"collective #{finished[0]}: {finished[1]}" if finished else None,
        launched=int(answer.get("seq", 0)),
        waited_seconds=float(answer.get("waited", 0.0)),
        user_line=f"{frame['file']}:{frame['line']} ({frame['function']}: {frame.get('code', '')})" if frame else None,
        stacks=answer.get("stacks"),
        collectives=answer.get("collectives", []),
        history=answer.get("history") or [],
    )


def _unanswered(rank: int, before: dict[str, Any] | None, after: dict[str, Any] | None, my_host: str) -> RankReport:
    if after is None:
        return RankReport(rank, "unknown: the store is unreachable, so its board cannot be read", False, False)
    if not after.get("pid"):
        return RankReport(rank, "unknown: it never published on the board (not started, or gone early)", False, False)
    host, pid = after.get("host"), int(after["pid"])
    beating = before is not None and before.get("beat") != after.get("beat")
    report = RankReport(
        rank, "", False, beating, host, pid, launched=int(after.get("seq", 0)), failed=after.get("failed")
    )
    if report.failed is not None:
        report.state = f"saw collective #{report.failed} fail and raised its own error (it may have exited since)"
        return report
    waiting = after.get("in")
    if waiting:
        report.waiting_in = f"collective #{waiting[0]}: {waiting[1]} (as its board said last)"
    if host != my_host:
        report.state = (
            "did not answer, though its heartbeat moves (busy in native code holding the GIL?)"
            if beating
            else f"did not answer, and its heartbeat has stopped (stopped, hung in native code, or gone) on {host}"
        )
        return report
    state = process_state(pid)
    if state is None:
        report.state = "gone (its process has exited)"
        return report
    if state.startswith("stopped"):
        report.state = f"stopped: {state}"
        return report
    report.state = f"did not answer from Python; its process is {state}"
    dump = after.get("dump")
    text = signal_dump(pid, dump) if dump else None
    if text:
        report.stacks_text, report.stacks_file = text, dump
        report.note = "stacks taken through faulthandler's signal (it could not answer from Python)"
        frame = user_frame(_faulthandler_frames(text))
        if frame is not None:
            report.user_line = f"{frame['file']}:{frame['line']} ({frame['function']})"
    return report


def _faulthandler_frames(text: str) -> list[dict[str, Any]]:
    """The frames of the thread that took the signal (the main thread), innermost last, from faulthandler's text."""
    block = text.split("Current thread", 1)[-1].split("\nThread ", 1)[0]
    frames = []
    for line in block.splitlines():
        found = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if found:
            frames.append({"file": found[1], "line": int(found[2]), "function": found[3].strip()})
    return list(reversed(frames))  # faulthandler lists the innermost first
