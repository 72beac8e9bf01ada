"""Calls one rank made and its peers did not: a ``torch.distributed`` collective of the user's, or a paratrain call.

Two mistakes hang a job in the same way: a collective of the user's own made on one rank only (an all-reduce under
``if rank == 0:``), and a paratrain call that only some ranks make (``par.barrier()``, ``par.save(...)`` or an
evaluation forward under ``if par.is_main:``). The rank that made it knows which: its group's sequence number
ran ahead of its peers' for the same collective of paratrain's (each rank's latest pairs are on the progress
board, :mod:`paratrain.diagnostics.mismatch`), and torch's Flight Recorder holds the extra collective's call site;
a rank stuck in a paratrain call has it on its stack. These name them::

    extra_collectives(group, history, {1: ring_of_rank_1})
    # -> "all_reduce(float [10]) at train.py:33, a collective rank 1 did not make (between ...)"
    paratrain_calls(report)
    # -> "rank 0 is in par.barrier() at train.py:40, rank 1 in par.backward() at train.py:35: every rank ..."
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from paratrain.diagnostics.flight_recorder import recent
from paratrain.diagnostics.mismatch import WINDOW, call_site, first_drift, is_ours
from paratrain.diagnostics.stacks import PACKAGE_DIR, user_frame

__all__ = ["extra_collectives", "paratrain_call", "paratrain_calls"]

_LOOP = {"backward", "step", "forward", "clip_grad_norm_"}  # what every rank runs at every step


def extra_collectives(group: Any, history: Sequence[Sequence[Any]], peers: Mapping[int, Sequence[Any]]) -> str | None:
    """The collectives this rank made that a peer did not, with their call sites; None when it made none.

    ``history``: this rank's [paratrain's number, the group's number, what] of its latest collectives (the
    monitor's); ``peers``: each peer's published ring of [paratrain's number, the group's number] pairs.
    """
    mine = [[int(e[0]), int(e[1])] for e in history]
    for rank, ring in sorted(peers.items()):
        drift = first_drift(mine, ring)
        if drift is None or drift[1] <= drift[2]:
            continue
        seq, here, there = drift
        theirs_by_seq = {int(s): int(g) for s, g in ring}
        # the extra collectives came after the latest of paratrain's on which both ranks agree (when both show one)
        agreed = [g for s, g in mine if s < seq and theirs_by_seq.get(s) == g]
        before = max(agreed) if agreed else max(0, here - WINDOW)
        what = next((str(e[2]) for e in history if int(e[0]) == seq and e[2]), "")
        ours = f"paratrain's collective #{seq}" + (f" ({what})" if what else "")
        found = [c.as_dict() for c in recent(group, frames=True, seqs=range(before + 1, here))]
        theirs = [c for c in found if not is_ours(c)]
        if not theirs:
            return (
                f"{here - there} collective(s) paratrain did not launch, before {ours}, which rank {rank} did not "
                f"make (the Flight Recorder does not say where)"
            )
        named = "; ".join(call_site(c) for c in theirs[-(here - there) :])  # the latest: the extra ones
        return f"{named}, which rank {rank} did not make, before {ours}"
    return None


def paratrain_call(frames: Sequence[dict[str, Any]]) -> tuple[str, str, bool] | None:
    """The paratrain call a stack (innermost frame last) is in, the user's line that made it, and whether every
    rank makes it at every step (a forward, a backward, a step); None outside paratrain."""
    frames = list(frames)
    user = user_frame(frames)
    if user is None:
        return None
    inner = frames[frames.index(user) + 1 :]
    ours = next((f for f in inner if str(f.get("file", "")).startswith(PACKAGE_DIR)), None)
    if ours is None:
        return None
    function, line = str(ours.get("function", "")), f"{user['file']}:{user['line']}"
    if str(ours.get("file", "")).endswith("parallel.py"):
        return f"par.{function}()", line, function in _LOOP
    if function == "forward":
        return "the prepared model's forward", line, True
    if any(f.get("function") == "backward" for f in inner):
        return "the backward", line, True
    return f"paratrain's {function}()", line, False


def paratrain_calls(report: Any) -> str:
    """``". rank 0 is in par.barrier() at x.py:16 ...: every rank calls par.barrier() at the same point"`` when the
    report's ranks are in different paratrain calls (or one is in a call and its peers left); "" otherwise."""
    calls: dict[int, tuple[str, str, bool]] = {}
    left: list[int] = []
    for r in report.ranks:
        main = next((s for s in r.stacks or [] if s.get("thread") == "MainThread"), None)
        found = paratrain_call(main["frames"]) if main else None
        if found is not None:
            calls[r.rank] = found
        elif r.state.startswith("gone") or "closed" in r.state:
            left.append(r.rank)
    names = {call for call, _, _ in calls.values()}
    odd = sorted({call for call, _, loop in calls.values() if not loop})
    if not calls or (len(names) == 1 and not (left and odd)):
        return ""
    where = ", ".join(f"rank {rank} in {call} at {line}" for rank, (call, line, _) in sorted(calls.items()))
    if left:
        where += f"; rank(s) {', '.join(map(str, left))} left without it"
    if odd:
        rule = "; ".join(f"every rank calls {c} at the same point, not under a condition on the rank" for c in odd)
    else:
        rule = "every rank runs the prepared model's forward and backward the same number of times"
    return f". The ranks are in different paratrain calls: {where}. {rule[0].upper()}{rule[1:]}"
