"""zero3's gradient reduces in flight: each unit's gradients summed across ranks into this rank's part.

    reduces = UnitReduces(group, monitor)
    reduces.launch(unit)          # the unit's gradients are whole: sum them (at most MAX_REDUCING in flight)
    reduces.settle_all()          # end of backward: every part summed and kept by its unit

On gloo the sum is an all-reduce in place (gloo's reduce-scatter is an all-reduce of a clone of the whole input,
which its Work holds: the same sums without the clone, as zero2's buckets on gloo), this rank's part kept; a unit
whose gradients were taken parameter by parameter (``unit.split``) all-reduces each large one and its small ones'
buffer. Elsewhere (NCCL) it is a reduce-scatter into a part of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.process_groups import no_python_in_work
from paratrain.sharded.flat_unit import ShardedUnit
from paratrain.sharded.reducer import reduce_scatter_into

__all__ = ["MAX_REDUCING", "UnitReduces"]

# units whose reduce-scatter may run at once; each holds the unit's whole gradient meanwhile. One: two made zero3's
# peak during backward the highest of the strategies (each unit a sixth of the 53.6M MLP; issue 26). On gloo a
# unit's reduce is also settled before the next unit's backward computes its gradients (settle_all at its start)
MAX_REDUCING = 1


@dataclass
class _Reducing:
    unit: ShardedUnit
    works: list[tuple[Any, int]]  # (Work, collective number): one, or one per tensor of a split backward
    out: torch.Tensor | None  # None: all-reduced in place (gloo): the unit's whole gradient, or a split backward's


class UnitReduces:
    """The units whose gradients are being summed, oldest first, and how their sums are started and kept."""

    def __init__(self, group: Any, monitor: CollectiveMonitor) -> None:
        self.group = group
        self.monitor = monitor
        self.in_place = dist.get_backend(group) == "gloo"
        self._reducing: list[_Reducing] = []

    def launch(self, unit: ShardedUnit) -> None:
        """Start summing ``unit``'s gradients (ready to reduce), after the oldest in flight if there is no room."""
        while len(self._reducing) >= MAX_REDUCING:
            self._settle(self._reducing[0])
        works: list[tuple[Any, int]] = []
        out: torch.Tensor | None = None
        with no_python_in_work():
            if unit.split:
                for tensor in unit.to_reduce():
                    seq = self.monitor.launched()
                    works.append((dist.all_reduce(tensor, group=self.group, async_op=True), seq))
            elif self.in_place:
                assert unit.grad_full is not None
                seq = self.monitor.launched()
                works.append((dist.all_reduce(unit.grad_full, group=self.group, async_op=True), seq))
            else:
                assert unit.grad_full is not None
                out = torch.empty(unit.part, dtype=unit.dtype, device=unit.device)
                seq = self.monitor.launched()
                works.append((reduce_scatter_into(out, unit.grad_full, self.group), seq))
        self._reducing.append(_Reducing(unit, works, out))

    def settle_all(self) -> None:
        """Wait for every reduce in flight; each unit keeps its part of the sum."""
        while self._reducing:
            self._settle(self._reducing[0])

    def _settle(self, reducing: _Reducing) -> None:
        unit = reducing.unit
        for work, seq in reducing.works:
            self.monitor.wait(work, seq, f"gradient reduce-scatter of unit {unit.label}")
        self._reducing.remove(reducing)
        if unit.split:  # each large parameter's gradient and the small ones' buffer all-reduced in place
            unit.add_split()
            return
        if reducing.out is None:  # all-reduced in place: this rank's part of the sum, the whole buffer freed
            assert unit.grad_full is not None
            reducing.out = unit.grad_full.narrow(0, unit.rank * unit.part, unit.part).clone()
        unit.add_reduced(reducing.out)
