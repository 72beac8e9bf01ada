"""The model fitted to what ``paratrain plan`` measured, for the world sizes it could not run. Pure.

    factor = compute_factor(measured=0.031, profiled=0.024)            # real ranks compute 1.29x slower
    fit = fit_overhead([MeasuredPoint(2, modelled=0.040, measured=0.052)])
    fit.extra(4)                                                         # seconds a ddp:4 step adds to the model
    errors = fit_errors(fit, points)                                     # {2: 0.0}: the fit at the measured sizes

At the world sizes this machine can run, plan runs the real strategy and takes the measurement as the answer.
Beyond them the step is the model's (:mod:`paratrain.tools.plan_model`: compute measured on one device, the
all-reduce measured between processes, the reducer's overlap simulated), corrected by two things those runs
showed it: how much slower the real ranks computed than one process measured alone (:func:`compute_factor`:
their peers share the cores, memory bandwidth and caches), and what a real ddp step spent beyond the modelled one
(:func:`fit_overhead`: the ranks' meeting, gloo's latency under load, per-step Python), as
``constant + per_ring x ring_factor(N)``. With one measured ddp size only the constant is fitted, so the fit
matches that size exactly and its error there says nothing of the extrapolation; the model's error before the
fit (:attr:`MeasuredPoint.model_error`) is printed beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.tools.plan_model import ring_factor

__all__ = ["CommFit", "MeasuredPoint", "compute_factor", "fit_errors", "fit_overhead"]


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured ddp world size: the model's step for it (before the fit) and the step measured."""

    world_size: int
    modelled: float  # seconds
    measured: float  # seconds

    @property
    def model_error(self) -> float:
        """The model's prediction error before the fit: modelled / measured - 1."""
        return self.modelled / self.measured - 1


@dataclass(frozen=True)
class CommFit:
    """What a ddp step spends beyond the model: ``constant + per_ring x ring_factor(N)`` seconds (0 for N = 1)."""

    constant: float = 0.0
    per_ring: float = 0.0
    points: int = 0  # the measured ddp world sizes it was fitted to

    def extra(self, world_size: int) -> float:
        if world_size < 2:
            return 0.0
        return self.constant + self.per_ring * ring_factor(world_size)


def compute_factor(measured: float, profiled: float) -> float:
    """How much slower the real run computed than plan's one-process profile of the same per-device batch (the
    comm-free phases, forward and optimizer): above 1 where the ranks' peers share a CPU's cores, memory bandwidth
    and caches, below 1 where the profile ran under heavier load than the run; 1 when either is missing."""
    if measured <= 0 or profiled <= 0:
        return 1.0
    return measured / profiled


def fit_overhead(points: Sequence[MeasuredPoint]) -> CommFit:
    """Fit ``measured - modelled`` at the measured ddp sizes (world size 2 and up).

    No point: nothing to fit (0). One world size: the constant alone. Two or more: least squares of the residual
    against ``ring_factor(N)``, weighted by 1 / measured^2 (relative error, as :func:`fit_link` fits).
    """
    ddp = [p for p in points if p.world_size > 1 and p.measured > 0]
    if not ddp:
        return CommFit()
    residuals = [(ring_factor(p.world_size), p.measured - p.modelled, 1.0 / p.measured**2) for p in ddp]
    sw = sum(w for _, _, w in residuals)
    mean_x = sum(w * x for x, _, w in residuals) / sw
    mean_r = sum(w * r for _, r, w in residuals) / sw
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in residuals)
    if len({p.world_size for p in ddp}) < 2 or sxx <= 0:
        return CommFit(mean_r, 0.0, len(ddp))
    slope = sum(w * (x - mean_x) * (r - mean_r) for x, r, w in residuals) / sxx
    return CommFit(mean_r - slope * mean_x, slope, len(ddp))


def fit_errors(fit: CommFit, points: Sequence[MeasuredPoint]) -> dict[int, float]:
    """World size -> the fitted model's error at that measured size: (modelled + extra) / measured - 1."""
    return {p.world_size: (p.modelled + fit.extra(p.world_size)) / p.measured - 1 for p in points if p.measured > 0}
