"""Ranks that part ways: one rank ran collectives of its own between paratrain's, so their numbers drift apart.

Every rank runs the same collectives in the same order in a correct program, so the n-th collective paratrain's
monitor launches has the same sequence number in its process group (torch counts every collective of a group,
the user's own ``torch.distributed`` calls included) on every rank. When a rank made a collective the others did
not (an all-reduce under ``if rank == 0:``, a log call with different keys per rank), its numbers run ahead: a
same-sized all-reduce would be summed silently into another rank's gradients. Each rank publishes its latest
(paratrain's number, the group's number) pairs on the board, and its board thread compares them with a peer's
within a beat (the rank ahead reports: it made the extra collective, and its own Flight Recorder says where,
:mod:`paratrain.diagnostics.skipped`)::

    drift = first_drift(mine=[[5, 12], [6, 13]], theirs=[[5, 12], [6, 14]])     # -> (6, 13, 14)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paratrain.diagnostics.stacks import PACKAGE_DIR, TORCH_DIRS, user_frame

__all__ = ["RING", "WINDOW", "call_site", "divergence", "first_drift", "is_ours"]

RING = 16  # the latest collectives each rank publishes
WINDOW = 64  # how far back the Flight Recorder is searched for the collective where ranks parted


def first_drift(mine: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> tuple[int, int, int] | None:
    """The first of paratrain's collectives both ranks launched whose group numbers differ: (its number, the
    group's number here, there); None when they agree on every one both published."""
    there = {int(seq): int(group_seq) for seq, group_seq in theirs}
    for seq, group_seq in sorted((int(a), int(b)) for a, b in mine):
        if seq in there and there[seq] != group_seq:
            return seq, group_seq, there[seq]
    return None


def divergence(
    mine: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The first collective number at which two ranks' Flight Recorder entries differ: in what they did, or in who
    called it (paratrain on one, the user's code on the other); the two entries, or None where they agree."""
    there = {int(c["seq"]): c for c in theirs}
    for here in sorted(mine, key=lambda c: int(c["seq"])):
        other = there.get(int(here["seq"]))
        if other is None:
            continue
        same_call = is_ours(here) == is_ours(other)
        if not same_call or (here["op"], here["sizes"], here["dtypes"]) != (
            other["op"],
            other["sizes"],
            other["dtypes"],
        ):
            return here, other
    return None


def call_site(collective: dict[str, Any], history: Sequence[Sequence[Any]] = ()) -> str:
    """``all_reduce(float [10]) at train.py:33``, or for one of paratrain's own what it was (from ``history``,
    the rank's [paratrain's number, the group's number, what] of its latest collectives)."""
    tensors = ", ".join(f"{d.lower()} {s}" for s, d in zip(collective["sizes"], collective["dtypes"], strict=False))
    described = f"{collective['op']}({tensors})"
    if is_ours(collective):
        what = next((e[2] for e in history if int(e[1]) == int(collective["seq"]) and e[2]), None)
        return f"paratrain's {what} ({described})" if what else f"{described} (one of paratrain's own)"
    frame = user_frame(list(collective.get("frames", [])))
    return f"{described} at {frame['file']}:{frame['line']}" if frame else described


def is_ours(collective: dict[str, Any]) -> bool:
    """True when paratrain's code called it (its innermost frame outside torch is paratrain's)."""
    for frame in reversed(list(collective.get("frames", []))):
        path = str(frame.get("file", ""))
        if path.startswith(TORCH_DIRS):
            continue
        return path.startswith(PACKAGE_DIR)
    return False
