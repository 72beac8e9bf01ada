"""Collectives that time out, or fail, with the names of the ranks responsible.

A collective that one rank never joins blocks the others until the backend's timeout (30 minutes by default),
and then says nothing about who was missing; one whose peer died fails with "Connection closed by peer
[127.0.0.1]:35733", which names no rank either. Here every collective is numbered, every rank publishes its
count and a heartbeat on the progress board (:mod:`paratrain.diagnostics.board`), and errors name the ranks that did not
arrive or went silent.

    monitor = CollectiveMonitor(group, timeout=60.0, namespace="ddp0")   # the same namespace on every rank
    seq = monitor.launched()
    work = dist.all_reduce(t, async_op=True)
    monitor.wait(work, seq, "gradient all-reduce of bucket 0")

How a wait is watched depends on where the collective runs:

- on the CPU (gloo) the host needs the result anyway, so it waits with the backend's own timeout and raises a
  :class:`DistributedError` the caller can catch;
- on GPUs (nccl) waiting on the host would serialise it with the GPU every step, so ``wait`` only orders the
  current stream after the collective and returns, and the board's thread checks the pending collectives once a
  heartbeat. One that is overdue is reported (named ranks) on stderr and the process ends with exit code 1, as
  torch's own NCCL watchdog does: the host thread may be stuck inside CUDA and could not raise.

After a collective timed out, this process's group holds a collective that will never complete: destroying the
group (explicitly, or when the interpreter exits and the last reference goes) joins gloo's threads, which wait for
that collective until the peer answers or the group's own timeout (30 minutes by default) passes, so the process
would outlive its error by that long. The error is a :class:`CollectiveError`, the monitor keeps it as
:attr:`CollectiveMonitor.failure`, and the group is kept alive to the end of the process
(:func:`paratrain.comm.process_groups.keep_forever`):
the exception reaches the user's script, the process exits as any failing script does, and the launcher stops
the other ranks. The ``Work`` that timed out or failed is kept as well, so that gloo's thread, which ends it,
never drops its last reference while the interpreter finalizes (:mod:`paratrain.comm.process_groups`).
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.ops import Works, serving_backend
from paratrain.comm.process_groups import default_store, group_sequence, keep_forever, to_seconds, wait_work
from paratrain.diagnostics.board import Board, cause_found_by, claim_diagnosis, diagnosed_by, found_cause
from paratrain.diagnostics.error_file import error_line, record_error
from paratrain.diagnostics.hang_report import ANSWERING_WAIT_S, Answerer, HangReport, gather
from paratrain.diagnostics.mismatch import RING, WINDOW, call_site, divergence, first_drift
from paratrain.diagnostics.skipped import extra_collectives, paratrain_calls
from paratrain.diagnostics.stacks import arm_signal_dump, drop_unused_dump
from paratrain.errors import CollectiveError

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveMonitor"]

DEFAULT_TIMEOUT_S = 300.0  # how long a collective may wait for the other ranks, everywhere in paratrain
DEFAULT_REPORT = "paratrain-hang-report.json"  # where a hang report goes unless told (the current directory)
EXIT_COLLECTIVE_FAILED = 1
# a rank behind its peer in the group's numbers leaves the report to the rank ahead (it alone knows the extra
# collective's call site) for this many heartbeats, then reports itself (the rank ahead may be unable to)
BEHIND_WAITS_BEATS = 3


@dataclass
class _Pending:
    """A collective the watchdog follows: the host did not wait for it."""

    work: Any
    seq: int
    what: str
    deadline: float


class CollectiveMonitor:
    """Numbers a wrapper's collectives and waits for them with a timeout that names the ranks responsible.

    Every rank must launch the same collectives in the same order (they do: the callers are deterministic),
    so the n-th launch on one rank is the n-th on every other. ``namespace`` must be the same on every rank of
    ``group`` and differ from that of any other live monitor on this rank (DistributedDataParallel agrees on
    one at start-up). Ranks in errors are global ranks (torchrun's RANK).

    ``host_waits`` chooses how waits are watched (see the module docstring): None picks by the backend that serves
    ``device``, the device of the collectives' tensors (the host waits on gloo, the watchdog follows nccl); tests force
    the watchdog on gloo with False. ``report_path`` is where
    a hang report goes; ``checks=False`` leaves out the drift check (benchmarks price it with it).
    """

    def __init__(
        self,
        group: Any,
        timeout: float | timedelta | None,
        namespace: str,
        *,
        host_waits: bool | None = None,
        report_path: str | None = None,
        checks: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        self.timeout = to_seconds(timeout)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self._group = group if group is not None else dist.group.WORLD
        nccl = serving_backend(self._group, device) == "nccl"  # it waits on the device's stream
        self.host_waits = not nccl if host_waits is None else host_waits
        self.report_path = report_path or DEFAULT_REPORT
        self._checks = checks  # the drift check and the group numbers it compares (False: benchmarks price them)
        self._seq = 0
        self.failure: str | None = None  # why a collective of this monitor timed out or failed
        self.waited = 0.0  # seconds this rank spent waiting in this monitor's collectives
        self._in: tuple[int, str, float] | None = None  # the collective being waited for, and since when
        self._done: tuple[int, str] | None = None  # the last one finished
        # (our number, the group's number, what) of the latest collectives: the board shows the last RING, a report
        # the WINDOW of them (which of the group's collectives were paratrain's, and what each was)
        self._history: deque[list[Any]] = deque(maxlen=WINDOW)
        self._pending: list[_Pending] = []
        self._behind_since: float | None = None  # when the drift check first saw this rank behind its peer
        self._diagnosing: threading.Thread | None = None  # the thread that says what went wrong: only one does
        self._said = threading.Event()
        self._lock = threading.Lock()
        self._dump = arm_signal_dump()  # a rank stuck in native code can still show its stacks
        if not faulthandler.is_enabled():  # a backend that aborts the process (gloo on mismatched sizes) shows where
            faulthandler.enable(all_threads=True)
        store = default_store() if self.timeout is not None else None
        global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self._board = None
        self._answerer: Answerer | None = None
        if store is not None:
            self._board = Board(store, namespace, self.rank, global_ranks, self._beat, status=self.status)
            self._answerer = Answerer(self._board, self._group, self.status)

    def close(self) -> None:
        """Stop the background thread; call before destroying the process group."""
        if self._board is not None:
            self._board.close()
            self._board = None

    def launched(self) -> int:
        """Record that this rank launches its next collective; returns its number."""
        self._seq += 1
        if self._checks:
            # the number the group gives the collective about to be launched: the same on every rank of a correct job
            self._history.append([self._seq, group_sequence(self._group) + 1, ""])
        if self._board is not None:
            self._board.post(self._seq)
        return self._seq

    def peers_gone(self) -> dict[int, str]:
        """Peers (global ranks) that went on past this point of the program, and how: they launched a collective of
        this monitor's group that this rank has not (seen on the board's ring, a heartbeat old at most), or closed
        their end of it. Such a peer cannot come to a meeting outside the group's collectives
        (:mod:`paratrain.comm.meeting`)."""
        board = self._board
        if board is None:
            return {}
        here = group_sequence(self._group) if self._checks else None
        gone: dict[int, str] = {}
        for rank, entry in board.read().items():
            if entry is None:
                continue
            latest = max((number for _, number in entry.get("ring") or []), default=0)
            if here is not None and latest > here:
                waiting = entry.get("in")  # [paratrain's number, what, seconds]: the collective it waits in
                inside = f" (it waits in {waiting[1]})" if waiting and len(waiting) > 1 else ""
                gone[rank] = f"launched the group's collective #{latest}{inside}"
            elif entry.get("closed"):
                gone[rank] = "closed its Parallel (or wrapper)"
        return gone

    def status(self, full: bool = False) -> dict[str, Any]:
        """What the board publishes for this monitor: the collective waited in, the last finished, the waiting,
        the latest collectives' numbers (``full``: the longer history a hang report carries, with what each was)."""
        waiting = self._in
        now = time.monotonic()
        history = list(self._history)
        return {
            "in": [waiting[0], waiting[1], now - waiting[2]] if waiting else None,
            "done": list(self._done) if self._done else None,
            "waited": self.waited + (now - waiting[2] if waiting else 0.0),
            "ring": [entry[:2] for entry in history[-RING:]],
            "history": history if full else None,
            "dump": self._dump,
        }

    def wait(self, handle: Any, seq: int, what: str) -> Any:
        """Wait for a ``Work`` (from ``async_op=True``) or a future; DistributedError when it fails or times out.

        A ``Work`` on the host's side is waited on with the backend's own timeout (no Python runs on the
        backend's threads); on the device's side it is handed to the watchdog. A future (from a communication
        hook, or :class:`~paratrain.comm.work_waiter.WorkWaiter`'s) is waited on through a completion callback.
        Returns the future's value, or None for a ``Work``.
        """
        if isinstance(handle, Works):  # one collective of ours made of several (a gather by broadcasts)
            for work in handle:
                self.wait(work, seq, what)
            return None
        is_work = isinstance(handle, dist.Work)  # else a future (torch._C.Future, not always torch.futures.Future)
        if is_work and not self.host_waits and self.timeout is not None and self._board is not None:
            with self._lock:
                self._pending.append(_Pending(handle, seq, what, time.monotonic() + self.timeout))
            handle.wait()  # nccl: the current stream waits for the collective; the host goes on
            return None
        started = time.monotonic()
        self._in = (seq, what, started)
        if self._checks:
            self._describe(seq, what)
        value = None
        try:
            if is_work:
                finished = wait_work(handle, self.timeout)
            else:
                finished = self.timeout is None or handle.done() or _wait_future(handle, self.timeout)
                if finished:
                    value = handle.wait()  # raises what failed it
                else:
                    keep_forever(handle)  # gloo's thread completes it some day: never its last reference
        except RuntimeError as exc:
            # from None: the error quotes the backend's text once; the backend's exception is kept on it
            self._claim_or_wait()
            raise self._failed(self.failure_error(seq, what, exc)) from None
        if not finished:
            self._claim_or_wait()
            raise self._failed(self.timeout_error(seq, what))
        self._in, self._done = None, (seq, what)
        self.waited += time.monotonic() - started
        return value

    def _describe(self, seq: int, what: str) -> None:
        for entry in reversed(self._history):  # the latest, usually the last or one of the last few
            if entry[0] == seq:
                entry[2] = what
                return
            if entry[0] < seq:
                return

    def _claim(self) -> bool:
        """True for the first thread of this process to say what went wrong here; False for any other."""
        with self._lock:
            if self._diagnosing is None:
                self._diagnosing = threading.current_thread()
            return self._diagnosing is threading.current_thread()

    def _claim_or_wait(self) -> None:
        """The host's wait failed or timed out: say why, unless the board's thread already does (the drift check,
        which ends the process when it has said it); then wait for that, so the console has one diagnosis."""
        if not self._claim():
            self._said.wait(2 * ANSWERING_WAIT_S)

    def _failed(self, error: CollectiveError) -> CollectiveError:
        if self.failure is None:
            self.failure = str(error)
            keep_forever(self._group)  # its teardown would wait for the collective that failed
        return error

    def _beat(self) -> None:
        """At every heartbeat, on the board's thread: the watchdog, the report's requests, the drift check."""
        self._watch()
        if self._answerer is not None:
            self._answerer.beat()
        if self._checks:
            try:
                self._check_drift()
            finally:  # reached only when it did not end the process: a host thread waiting on it goes on
                if self._diagnosing is threading.current_thread():
                    self._said.set()

    def _watch(self) -> None:
        """Drop finished collectives the host did not wait for; end the process for an overdue one."""
        with self._lock:
            self._pending = [p for p in self._pending if not p.work.is_completed()]
            overdue = next((p for p in self._pending if time.monotonic() > p.deadline), None)
        if overdue is None:
            return
        error = self._failed(self.timeout_error(overdue.seq, overdue.what))
        self._leave(error)  # the host thread may be blocked in CUDA: only leaving ends the hang

    def _check_drift(self) -> None:
        """Compare this rank's collective numbers with a peer's; end the job, with a report, where they part."""
        board = self._board
        if board is None or self.world_size < 2 or self.failure is not None:
            return
        peer = board.global_ranks[1 if board.rank == 0 else 0]
        entry = board.read_one(peer)
        # all of this rank's history: a peer far behind in its steps published a ring older than this rank's last
        drift = first_drift([e[:2] for e in self._history], (entry or {}).get("ring") or [])
        if drift is None:
            return
        seq, here, there = drift
        if here < there and not self._behind_long_enough(entry or {}):
            return  # the rank ahead made the extra collective, knows where, and says so
        if not self._claim():
            return  # the host's wait failed first, and says why (this rank's extra collective too)
        found_cause(board.store, self.global_rank)  # the peer's collective fails when this rank leaves: it says so
        if here > there:
            board.failed(seq)  # the peer behind sees that this rank is reporting
        ahead, behind = (self.global_rank, peer) if here > there else (peer, self.global_rank)
        what = (
            f"ranks ran different collectives: paratrain's collective #{seq} is the group's #{here} on rank "
            f"{self.global_rank} but #{there} on rank {peer}, so rank {ahead} ran {abs(here - there)} collective(s) "
            f"rank {behind} did not (a torch.distributed call under a condition on the rank?)"
        )
        if here > there:  # this rank made the extra collective: its own record says which, and where
            extra = extra_collectives(self._group, list(self._history), {peer: (entry or {}).get("ring") or []})
            if extra:
                self._leave_first(seq, f"rank {self.global_rank}: {what}: rank {self.global_rank} ran {extra}")
        report = self._report(seq, what, seqs=range(max(1, min(here, there) - WINDOW), max(here, there) + 1))
        error = self._failed(
            CollectiveError(
                f"rank {self.global_rank}: {what}{_parted(report)}{_report_suffix(report)}",
                summary=_summary(self.global_rank, "ranks ran different collectives"),
            )
        )
        self._leave(error, report)

    def _leave_first(self, seq: int, message: str) -> None:
        """Say ``message`` at once, then gather the report (its answers without call sites: quick) and leave; the
        peers' own errors, which may end the job meanwhile, come after this rank's."""
        error = self._failed(
            CollectiveError(
                f"{message}. A hang report follows (every rank's state, collective and stacks): {self.report_path}",
                summary=_summary(self.global_rank, "ranks ran different collectives"),
            )
        )
        print(f"paratrain: {error}", file=sys.stderr, flush=True)
        report = self._report(seq, str(error).partition(": ")[2])
        if report is not None:
            print(report.render(), file=sys.stderr, flush=True)
        # recorded last: a rank stopped by the launcher meanwhile must not look like the job's first failure
        record_error(error_line(error))
        sys.stdout.flush()
        drop_unused_dump()
        os._exit(EXIT_COLLECTIVE_FAILED)

    def _behind_long_enough(self, peer_entry: dict[str, Any]) -> bool:
        """This rank is behind its peer: True once the peer, ahead, has had its heartbeats to report and did not."""
        if peer_entry.get("failed") is not None:
            return False  # the peer is reporting (or failed on its own): its error says more than this rank could
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        interval = self._board.interval if self._board is not None else 1.0
        return now - self._behind_since >= BEHIND_WAITS_BEATS * interval

    def _leave(self, error: CollectiveError, report: HangReport | None = None) -> None:
        """End this process from the board's thread, with the error and the report on stderr (exit code 1)."""
        if report is not None:
            print(report.render(), file=sys.stderr, flush=True)
        print(f"paratrain: {error}", file=sys.stderr, flush=True)
        record_error(error_line(error))  # the launcher's summary: one short line pointing here
        sys.stdout.flush()
        drop_unused_dump()  # os._exit skips atexit, where the stack file would go
        os._exit(EXIT_COLLECTIVE_FAILED)

    def _report(self, seq: int, what: str, seqs: range | None = None) -> HangReport | None:
        """Gather the hang report and write it, from one rank of the job (the first to notice); None elsewhere."""
        board = self._board
        if board is None:
            return None
        if not claim_diagnosis(board.store, self.global_rank):  # one report a job, from any monitor
            return None
        report = gather(board, self._group, self.status(True), seq=seq, what=what, timeout=self.timeout, seqs=seqs)
        try:
            report.write(self.report_path)
        except OSError as exc:
            report.path = None
            print(f"paratrain: could not write the hang report to {self.report_path}: {exc}", file=sys.stderr)
        return report

    def timeout_error(self, seq: int, what: str, missing_ranks: list[int] | None = None) -> CollectiveError:
        """The error for collective ``seq`` not completing in time, naming the ranks that did not arrive (by the
        board's counts, or ``missing_ranks`` where the caller knows them: a meeting before the collective); the first
        rank to notice gathers the hang report (every rank's state, collective and stacks) and prints it."""
        if self._board is None:
            who, report = "the process group has no store to tell which ranks are missing", None
        else:
            missing, unknown = self._board.behind(seq)
            if missing_ranks is not None:
                missing = list(missing_ranks)
            self._board.failed(seq)
            report = self._report(seq, f"{what} (collective #{seq}) did not complete within {self.timeout:g}s")
            if report is not None:
                silent = [r.rank for r in report.ranks if r.silent]
            else:
                silent, _ = self._board.silent()
            if missing:
                who = f"rank(s) {_ranks(missing)} did not arrive"
                quiet = [r for r in missing if r in silent]
                if quiet:
                    who += f"; rank(s) {_ranks(quiet)} show no sign of life (stopped, hung in native code, or dead)"
            elif silent:
                who = f"every rank launched it, and rank(s) {_ranks(silent)} show no sign of life since"
            elif not unknown:
                who = "every rank launched it, so one of them is stuck inside it (or the network is)"
            else:
                who = "the store is unreachable"
            if unknown:
                who += f" (rank(s) {_ranks(unknown)} could not be asked: the store is unreachable)"
            if report is None:
                who += self._pointer()
        if report is not None:
            print(report.render(), file=sys.stderr, flush=True)
        return CollectiveError(
            f"rank {self.global_rank}: {what} (collective #{seq}) did not complete within {self.timeout:g}s: {who}"
            f"{self._why(report)}. "
            f"Check those processes (stuck, crashed, or skipping a forward/backward the others ran); use "
            f"join() for uneven inputs; raise the limit with timeout=... (paratrain train --timeout)"
            f"{_report_suffix(report)}",
            summary=_summary(self.global_rank, f"{what} (collective #{seq}) did not complete"),
        )

    def failure_error(self, seq: int, what: str, exc: BaseException) -> CollectiveError:
        """The error for collective ``seq`` failing (a peer closed its connection, say), naming silent ranks."""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        other = self._cause_elsewhere()
        if other is not None:  # that rank said what went wrong, and left: this rank's collective failed with it
            return CollectiveError(
                f"rank {self.global_rank}: {what} (collective #{seq}) failed when rank {other} stopped; rank {other}'s "
                f"error says why",
                summary=f"rank {self.global_rank}: {what} failed when rank {other} stopped; see rank {other}'s error",
                backend_error=exc,
            )
        who, report = "", None
        if self._board is not None:
            self._board.failed(seq)
            report = self._report(seq, f"{what} (collective #{seq}) failed ({reason})")
            if report is not None:
                silent = [r.rank for r in report.ranks if r.silent]
                unknown = [r.rank for r in report.ranks if r.state.startswith("unknown")]
                print(report.render(), file=sys.stderr, flush=True)
            else:
                silent, unknown = self._board.silent()
            if silent:
                who = f": rank(s) {_ranks(silent)} stopped responding (their process probably exited; see its error)"
            elif unknown:
                who = ": the store is unreachable, so its host (the launcher, or rank 0) is probably gone"
        return CollectiveError(
            f"rank {self.global_rank}: {what} (collective #{seq}) failed{who} ({reason}){self._why(report)}"
            f"{_report_suffix(report)}",
            summary=_summary(self.global_rank, f"{what} (collective #{seq}) failed"),
            backend_error=exc,
        )

    def refusal(self, message: str, short: str) -> CollectiveError:
        """The error for a mistake this rank found before launching anything (a call its peers did not make, seen in
        a meeting): ``message`` whole when this rank is the job's first to diagnose what went wrong, else ``short``
        pointing to the rank that did; the launcher's summary quotes ``short`` either way. ``message`` starts with
        ``rank N: ``."""
        store = self._board.store if self._board is not None else None
        if store is not None:
            found_cause(store, self.global_rank)
        if store is None or claim_diagnosis(store, self.global_rank):
            return CollectiveError(message, summary=_summary(self.global_rank, short))
        return CollectiveError(
            f"rank {self.global_rank}: {short}{self._pointer()}", summary=f"rank {self.global_rank}: {short}"
        )

    def unmet_error(self, what: str, missing: list[int]) -> CollectiveError:
        """The error for the collective this rank was about to launch (its next number) when ``missing`` did not come
        to the meeting before it within the timeout: :meth:`timeout_error`'s, with the hang report."""
        return self._failed(self.timeout_error(self._seq + 1, what, missing))

    def _diagnosed_elsewhere(self) -> int | None:
        """The rank that gave the job's diagnosis (its hang report, or the mistake it found), when not this one."""
        by = diagnosed_by(self._board.store) if self._board is not None else None
        return by if by is not None and by != self.global_rank else None

    def _cause_elsewhere(self) -> int | None:
        """The rank that found the job's mistake and left because of it, when not this one."""
        by = cause_found_by(self._board.store) if self._board is not None else None
        return by if by is not None and by != self.global_rank else None

    def _pointer(self) -> str:
        other = self._diagnosed_elsewhere()
        return f"; rank {other}'s error has the diagnosis" if other is not None else ""

    def _why(self, report: HangReport | None) -> str:
        """What made the ranks part, where this rank or the report can tell: a collective of the user's this rank
        made and a peer did not (from the peers' rings on the board and this rank's Flight Recorder), or ranks in
        different paratrain calls (from the report's stacks)."""
        board = self._board
        if board is None:
            return ""
        extra = None
        if self._checks and self.world_size > 1:
            rings = {rank: (entry or {}).get("ring") or [] for rank, entry in board.read().items()}
            extra = extra_collectives(self._group, list(self._history), rings)
        if extra:
            return (
                f". The cause: rank {self.global_rank} ran {extra}; every rank makes the same collectives in the "
                f"same order"
            )
        return paratrain_calls(report) if report is not None else ""


def _summary(rank: int, what: str) -> str:
    """The launcher's line for a rank whose error was printed whole: it points there."""
    return f"rank {rank}: {what}; the diagnosis is in rank {rank}'s output above"


def _wait_future(future: Any, timeout: float) -> bool:
    """Whether ``future`` completed within ``timeout`` seconds (a callback sets an event: no Python polls it)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done.wait(timeout)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _report_suffix(report: HangReport | None) -> str:
    return f". Hang report (every rank's state, collective and stacks): {report.path}" if report and report.path else ""


def _parted(report: HangReport | None) -> str:
    """Where the ranks parted, from their Flight Recorder entries: the first collective number they disagree on."""
    if report is None:
        return ""
    answered = [r for r in report.ranks if r.answered and r.collectives]
    for first, second in itertools.pairwise(answered):
        found = divergence(first.collectives, second.collectives)
        if found is not None:
            here, there = found
            return (
                f". They parted at the group's collective #{here['seq']}: rank {first.rank} ran "
                f"{call_site(here, first.history)}, rank {second.rank} ran {call_site(there, second.history)}"
            )
    return ""
