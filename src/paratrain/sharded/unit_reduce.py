"""zero3's gradient reduces in flight: each unit's gradients summed across ranks into this rank's part.

    reduces = UnitReduces(ops, monitor)
    reduces.launch(unit)          # the unit's gradients are whole: sum them (at most MAX_REDUCING in flight)
    reduces.settle_all()          # end of backward: every part summed and kept by its unit

The sum is :class:`~paratrain.comm.ops.GroupOps`'s reduce-scatter of the unit's whole gradient into a part of
its own (on gloo an all-reduce of the whole gradient in place, this rank's part copied out when it is done).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.ops import GroupOps, Reduction
from paratrain.sharded.flat_unit import ShardedUnit

__all__ = ["MAX_REDUCING", "UnitReduces"]

# units whose reduce-scatter may run at once; each holds the unit's whole gradient meanwhile. One: two made zero3's
# peak during backward the highest of the strategies (each unit a sixth of the 53.6M MLP; issue 26). Where the
# reduce is in place (gloo) a unit's is also settled before the next unit's backward computes its gradients
MAX_REDUCING = 1


@dataclass
class _Reducing:
    unit: ShardedUnit
    reduction: Reduction
    seq: int


class UnitReduces:
    """The units whose gradients are being summed, oldest first."""

    def __init__(self, ops: GroupOps, monitor: CollectiveMonitor) -> None:
        self.ops = ops
        self.monitor = monitor
        self._reducing: list[_Reducing] = []

    @property
    def in_place(self) -> bool:
        """Whether a reduce holds the unit's whole gradient until it is settled (gloo's all-reduce in place)."""
        return self.ops.reduces_in_place

    def launch(self, unit: ShardedUnit) -> None:
        """Start summing ``unit``'s gradients (ready to reduce), after the oldest in flight if there is no room."""
        while len(self._reducing) >= MAX_REDUCING:
            self._settle(self._reducing[0])
        assert unit.grad_full is not None, "ready_to_reduce() comes first"
        out = torch.empty(unit.part, dtype=unit.dtype, device=unit.device)
        seq = self.monitor.launched()
        self._reducing.append(_Reducing(unit, self.ops.reduce_scatter(out, unit.grad_full), seq))

    def settle_all(self) -> None:
        """Wait for every reduce in flight; each unit keeps its part of the sum."""
        while self._reducing:
            self._settle(self._reducing[0])

    def _settle(self, reducing: _Reducing) -> None:
        unit = reducing.unit
        self.monitor.wait(reducing.reduction.work, reducing.seq, f"gradient reduce-scatter of unit {unit.label}")
        self._reducing.remove(reducing)
        reducing.reduction.finish()
        unit.add_reduced(reducing.reduction.part)
