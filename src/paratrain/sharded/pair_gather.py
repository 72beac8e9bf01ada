"""An all-gather between two ranks on gloo as a send and a receive: the same bytes, without gloo's copies.

    pair = PairGather.between(group, world_size, tensors)   # None unless two ranks on gloo, the tensors on CPU
    done = pair.exchange(mine, theirs, seq)                 # send ``mine``, receive the peer's into ``theirs``
    monitor.wait(done, seq, what)                           # a future: pollable with done()

At two ranks an all-gather is each rank sending its part and receiving the other's. gloo's all-gather does that
through a flat output and copies around it; a send of this rank's part and a receive straight into the peer's
place move the same bytes without them (5.4 against 8.7 ms for 14.1 MiB here, ``benchmarks/bench_zero_phases.py``).
gloo's send and receive report completion only once waited for, and a second wait never returns, so they are
handed to a thread that waits for each once (:class:`paratrain.comm.work_waiter.WorkWaiter`), and the caller gets
a future. The pair is tagged with its collective number, which is the same on both ranks, so each receive
matches the peer's send of the same collective. zero1 and zero2 gather the updated weights this way
(:mod:`paratrain.sharded.zero`), zero3 each unit's weights (:mod:`paratrain.sharded.flat_unit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.process_groups import keep_forever, no_python_in_work
from paratrain.comm.work_waiter import WorkWaiter
from paratrain.sharded.reducer import TAG_BASE

__all__ = ["PairGather"]


class PairGather:
    """This rank's sends to and receives from its one peer, waited for by a thread of their own."""

    def __init__(self, group: Any, rank: int, name: str) -> None:
        self._group = group
        self.peer = dist.get_global_rank(group, 1 - rank) if group is not None else 1 - rank
        self._waiter = WorkWaiter(name)

    @classmethod
    def between(cls, group: Any, world_size: int, tensors: Iterable[torch.Tensor], name: str) -> PairGather | None:
        """A pair for ``group`` when it has two ranks on gloo and ``tensors`` (what is gathered) are on the CPU."""
        if world_size != 2 or dist.get_backend(group) != "gloo":
            return None
        if not all(t.device.type == "cpu" for t in tensors):
            return None
        return cls(group, dist.get_rank(group), name)

    def exchange(self, mine: torch.Tensor, theirs: torch.Tensor, seq: int) -> torch.futures.Future[None]:
        """Send ``mine`` to the peer and receive its part into ``theirs``: a future done when both are, or failed
        with the backend's error (also when the peer's connection was gone at launch), which the monitor's wait
        names as it names a failed all-gather."""
        works: list[Any] = []
        try:
            with no_python_in_work():
                works.append(dist.isend(mine, self.peer, self._group, TAG_BASE + seq))
                works.append(dist.irecv(theirs, self.peer, self._group, TAG_BASE + seq))
        except RuntimeError as exc:
            keep_forever(*works)  # gloo may still hold a send it started (see paratrain.comm.process_groups)
            failed: torch.futures.Future[None] = torch.futures.Future()
            failed.set_exception(exc)  # type: ignore[arg-type]  # torch types it as a result
            return failed
        return self._waiter.after(works)

    def close(self) -> None:
        """End the waiting thread once what was given is done."""
        self._waiter.close()
