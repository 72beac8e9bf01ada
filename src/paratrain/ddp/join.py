"""Uneven inputs under DistributedDataParallel: ranks that run out of batches shadow the others' collectives.

    with ddp.join():                      # rank r may have fewer batches than the others
        for x, y in loader:
            loss_fn(ddp(x), y).backward(); optimizer.step(); optimizer.zero_grad()

Each forward of an active rank first takes part in one small all-reduce that counts the active ranks and says
whether this iteration synchronises gradients. A rank that left its loop (in ``__exit__``) answers that
all-reduce with zeros, then takes part in the buffer broadcast and the gradient all-reduces with zeros, until
no rank is active. Then every rank copies the model of the last rank to finish, so the replicas end equal (a
joined rank missed the optimizer steps of the iterations it shadowed). torch's ``DistributedDataParallel.join``
does the same with the same options.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.ddp.reducer import Reducer
from paratrain.errors import DistributedError

__all__ = ["Join"]


class _Wrapper(Protocol):
    """What Join uses of DistributedDataParallel (a protocol: distributed.py imports this module)."""

    rank: int
    world_size: int
    process_group: Any
    monitor: CollectiveMonitor
    reducer: Reducer
    module: nn.Module
    forward_sync_buffers: bool
    require_forward_param_sync: bool
    _join: Join | None

    def _control_device(self) -> torch.device: ...

    def _broadcast(self, tensors: Sequence[torch.Tensor], what: str, src: int = 0) -> None: ...

    def _sync_final_model(self, last_to_finish: bool) -> None: ...

    def _synced(self, *, parameters: bool, buffers: bool) -> list[torch.Tensor]: ...


class Join:
    """The context manager returned by :meth:`DistributedDataParallel.join`.

    Args:
        ddp: the wrapper whose ranks may run out of inputs at different iterations.
        divide_by_initial_world_size: divide the summed gradients by the world size (joined ranks count as
            zeros), or by the number of ranks still active in each iteration.
        enable: ``False`` makes the block do nothing (inputs must then be even).
        throw_on_early_termination: raise on every rank as soon as one rank runs out of inputs, instead of
            shadowing it.
    """

    def __init__(
        self,
        ddp: _Wrapper,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination

    def __enter__(self) -> Join:
        if self.enable:
            self.ddp._join = self
        return self

    def _flags(self, active: bool, sync: bool) -> tuple[int, bool, int]:
        """One all-reduce: how many ranks are active, whether they synchronise, and the highest active rank."""
        ddp = self.ddp
        # [active count, syncing count, one slot per rank: 1 where that rank is active]
        flags = torch.zeros(2 + ddp.world_size, dtype=torch.int64, device=ddp._control_device())
        if active:
            flags[0], flags[1], flags[2 + ddp.rank] = 1, int(sync), 1
        seq = ddp.monitor.launched()
        work = dist.all_reduce(flags, group=ddp.process_group, async_op=True)
        ddp.monitor.wait(work, seq, "join: active-rank count")
        counts = flags.tolist()
        active_ranks = [r for r, on in enumerate(counts[2:]) if on]
        return counts[0], counts[1] > 0, max(active_ranks, default=0)

    def announce(self, sync: bool) -> int:
        """An active rank's forward: count it; returns the rank whose buffers this iteration broadcasts."""
        active, _, authority = self._flags(True, sync)
        if self.throw_on_early_termination and active < self.ddp.world_size:
            raise DistributedError(self._early_termination(active))
        if not self.divide_by_initial_world_size:
            self.ddp.reducer.collective.divisor = active
        return authority

    def _early_termination(self, active: int) -> str:
        return (
            f"rank {self.ddp.rank}: {self.ddp.world_size - active} rank(s) ran out of inputs while {active} still had "
            f"some; join(throw_on_early_termination=True) raises on every rank then. Give every rank the same "
            f"number of batches, or leave throw_on_early_termination=False so the others are shadowed"
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ddp = self.ddp
        try:
            if exc_type is not None or not self.enable:
                return  # a failing rank must not pretend to be done; the error propagates
            last_to_finish = True
            while True:
                active, syncing, authority = self._flags(False, False)
                if active == 0:
                    break  # everyone is done
                if self.throw_on_early_termination:
                    raise DistributedError(self._early_termination(active))
                last_to_finish = False
                if ddp.forward_sync_buffers and ddp.require_forward_param_sync:  # as the active ranks decide
                    buffers = ddp._synced(parameters=False, buffers=True)
                    ddp._broadcast(buffers, "buffer broadcast (joined rank)", src=authority)
                ddp.require_forward_param_sync = syncing
                if syncing:
                    ddp.reducer.shadow()
            ddp._sync_final_model(last_to_finish)
        finally:
            ddp._join = None
            ddp.reducer.collective.divisor = ddp.world_size
