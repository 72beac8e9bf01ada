"""What torch's Flight Recorder saw: each collective of a process group, by its sequence number in that group.

torch records every collective of every process group (gloo too) in a ring buffer: its sequence number in its
group, the operation, the tensors' sizes and dtypes, whether it finished, and the Python frames that called it.
paratrain reads it when ranks disagree, so a report can say "rank 0 called all_reduce of float32 [4] at
train.py:33 where rank 1 ran the gradient all-reduce of bucket 0 (reducer.py)"::

    recent(group, last=8)                 # this process's latest collectives of ``group``, oldest first
    recent(group, last=8, frames=True)    # with their call sites (slower: torch symbolises every entry)

The buffer's size is torch's ``TORCH_FR_BUFFER_SIZE`` (2000 by default, read when a process group is created);
reading costs about 13 us per entry without frames and about 1 ms per entry with them here, so paratrain's
launcher and its ddp strategy ask torch for a buffer of :data:`BUFFER_SIZE` when the user has not chosen one.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BUFFER_SIZE", "Collective", "recent", "small_buffer_unless_set"]

BUFFER_SIZE = 64  # entries: enough to see where ranks parted, cheap to read


@dataclass(frozen=True)
class Collective:
    """One recorded collective of a group."""

    seq: int  # its number in its group, the same on every rank for the same collective
    op: str  # e.g. "all_reduce", "barrier", "broadcast"
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    finished: bool
    frames: tuple[dict[str, Any], ...] = field(default=(), compare=False)  # innermost last

    @property
    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """What every rank must agree on at the same sequence number."""
        return self.op, self.sizes, self.dtypes

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "sizes": [list(s) for s in self.sizes], "dtypes": list(self.dtypes),
                "finished": self.finished, "frames": list(self.frames)}  # fmt: skip

    def describe(self) -> str:
        tensors = ", ".join(f"{d.lower()} {list(s)}" for s, d in zip(self.sizes, self.dtypes, strict=False))
        return f"{self.op}({tensors})" if tensors else self.op


def small_buffer_unless_set(environ: Any = None) -> None:
    """Ask for a Flight Recorder buffer of :data:`BUFFER_SIZE` entries unless the user set one (before a group)."""
    (os.environ if environ is None else environ).setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_SIZE))


def recent(group: Any, last: int = 8, *, frames: bool = False, seqs: range | None = None) -> list[Collective]:
    """This process's ``last`` latest collectives of ``group`` from the Flight Recorder (or those numbered in
    ``seqs``), oldest first.

    Empty when the recorder is off or this torch has none.
    """
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return []
    try:
        trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=frames, onlyActive=False))
    except Exception:  # a recorder that is off, or a torch that records differently: nothing to say
        return []
    name = getattr(group, "group_name", None)
    found = []
    for entry in trace.get("entries", []):
        if entry.get("is_p2p") or (name is not None and entry.get("process_group", ("",))[0] != name):
            continue
        op = str(entry.get("profiling_name", "")).split(":", 1)[-1]
        found.append(
            Collective(
                seq=int(entry.get("collective_seq_id", 0)),
                op=op,
                sizes=tuple(tuple(s) for s in entry.get("input_sizes", [])),
                dtypes=tuple(entry.get("input_dtypes", [])),
                finished=bool(entry.get("retired")) or entry.get("state") == "completed",
                frames=tuple(
                    {"file": f.get("filename", ""), "line": f.get("line", 0), "function": f.get("name", "")}
                    for f in reversed(entry.get("frames") or [])
                ),
            )
        )
    if seqs is not None:
        return [c for c in found if c.seq in seqs]
    return found[-last:]
