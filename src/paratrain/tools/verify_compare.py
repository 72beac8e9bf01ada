"""verify's comparison: how far a configuration is from one device, and how far it may be.

    tolerance = Tolerance.entitled(single, exact, compute=torch.float32)   # or Tolerance.fixed(1e-5, 1e-7)
    found = compare(single, other, order, tolerance, exact)

Splitting a batch over devices sums the same terms in another order, so a configuration's losses, gradients and
parameters differ from one device's by rounding. How much rounding depends on the computation: about 3e-7
relative for SGD on float32, but AdamW divides every update by the root of a running mean of squared gradients,
so a gradient near zero moves its parameter by about the learning rate whatever its rounding, and reduced
precision rounds to 3 digits (bf16) in every layer: clean models then differ by 1e-4 relative and more. No fixed
tolerance fits every computation, so by default the entitlement is measured: single is also run in float64
(``exact``: parameters, data and every step, no autocast), and a configuration passes where its distance from
that run is within :data:`FACTOR` times single's own distance from it, tensor by tensor and step by step. A
configuration that differs for a reason (BatchNorm statistics of a share, a mask drawn per device, a loss off by
the device count) is 1e-3 and more away, orders of magnitude past its rounding.

The float64 run measures rounding only when it computes what single computes. Where single's distance from it
is beyond rounding (randomness that depends on the dtype, or forward passes that differ run to run), or when
``--rtol/--atol`` are given, the comparison is with single, within those tolerances (by default the dtype's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.tools.runner import ConfigRunError

__all__ = ["FACTOR", "Comparison", "Tolerance", "compare", "difference", "fixed_tolerance"]

# a configuration may round this many times worse than single does, on each tensor and step: clean models were
# measured at up to 4.9x (AdamW, 10 steps, seeds 0-9, dp over 2 and 3 CPU replicas), a difference with a cause
# at 1e4x and more
FACTOR = 16.0
# one unit of rounding of the compute dtype (of a tensor's largest value) counts as rounding, even where single's
# distance is smaller (single may round a tensor the exact way by chance)
_FLOOR_EPS = 1.0
# single's first-step gradients further than this many units of rounding from float64's: not rounding
_PLAUSIBLE_EPS = 1000.0

# (rtol, atol) by compute dtype for the comparison with single: float32 keeps ~7 digits; sums over a batch and a
# few SGD steps lose one or two (up to ~2e-6 relative measured here), so 1e-5 leaves a margin
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.bfloat16: (2e-2, 1e-4),
    torch.float16: (2e-3, 1e-5),
}
QUANTITIES = ("loss", "gradient", "parameter")


def fixed_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of the comparison with single for a computation in ``dtype``."""
    return _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])


def difference(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(max |a - b|, max |b|); a tensor missing on one side only, or of another shape, is infinitely far."""
    if a is None or b is None:
        return (0.0, 0.0) if a is None and b is None else (float("inf"), 0.0)
    if a.shape != b.shape:
        return float("inf"), 0.0
    if not a.numel():
        return 0.0, 0.0
    return float((a.double() - b.double()).abs().max()), float(b.double().abs().max())


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


@dataclass(frozen=True)
class Tolerance:
    """The rule a configuration is judged by: ``entitled`` (measured against float64) or ``fixed``."""

    rule: str  # "float64" or "fixed"
    rtol: float  # fixed: of max|single| per tensor
    atol: float
    eps: float  # the compute dtype's unit of rounding
    why: str = ""  # why the fixed rule applies (given, or the float64 run could not measure rounding)

    @classmethod
    def fixed(cls, rtol: float, atol: float, dtype: torch.dtype, why: str) -> Tolerance:
        return cls("fixed", rtol, atol, torch.finfo(dtype).eps, why)

    @classmethod
    def entitled(
        cls, single: dict[str, Any], exact: dict[str, Any], dtype: torch.dtype, nondeterministic: bool
    ) -> Tolerance:
        """The float64 rule, unless the float64 run cannot measure single's rounding (then ``dtype``'s fixed)."""
        eps = torch.finfo(dtype).eps
        rtol, atol = fixed_tolerance(dtype)
        if nondeterministic:
            return cls("fixed", rtol, atol, eps, "forward passes differ run to run, so float64 measures no rounding")
        # against the largest gradient anywhere: a gradient that is zero in exact arithmetic (a bias before a
        # BatchNorm) is pure rounding in float32, infinitely far relative to itself
        pairs = [difference(a, b) for a, b in zip(single["grads"][0], exact["grads"][0], strict=True)]
        far = _relative(max((d for d, _ in pairs), default=0.0), max((s for _, s in pairs), default=0.0))
        if far > _PLAUSIBLE_EPS * eps:
            return cls(
                "fixed",
                rtol,
                atol,
                eps,
                f"single's first gradients are {far:.1e} relative from float64's, beyond rounding (randomness that "
                "depends on the dtype?)",
            )
        return cls("float64", rtol, atol, eps)

    def describe(self) -> str:
        if self.rule == "float64":
            return (
                f"each tensor within {FACTOR:g}x single's own rounding, measured against single run in float64 "
                f"(at least {_FLOOR_EPS:g} unit of {self.eps:.1e} relative)"
            )
        because = f" ({self.why})" if self.why else ""
        return f"max|diff| <= {self.atol:g} + {self.rtol:g} x max|single| per tensor{because}"


@dataclass
class Comparison:
    """One configuration against single: the largest differences, the first divergence, the verdict."""

    max_abs: dict[str, float]  # against single, per quantity
    max_rel: dict[str, float]
    rounding: dict[str, float]  # float64 rule: the largest distance from float64 in units of single's
    first: dict[str, Any] | None
    ok: bool


def compare(
    single: dict[str, Any],
    other: dict[str, Any],
    order: Sequence[str],
    tolerance: Tolerance,
    exact: dict[str, Any] | None = None,
) -> Comparison:
    """Every step's loss, gradients and parameters of ``other`` judged by ``tolerance`` (see the module).

    The first divergence is at the earliest step where a gradient or a parameter is out of tolerance: the first
    such parameter in forward ``order``, its gradient if that diverges, else its value after the step.
    """
    if other["names"] != single["names"]:
        raise ConfigRunError("the configuration's model has different parameters from single's")
    if tolerance.rule == "float64" and exact is None:
        raise ValueError("the float64 rule needs the float64 run")
    names = single["names"]
    position = {name: i for i, name in enumerate(names)}
    ranked = [n for n in order if n in position] + [n for n in names if n not in order]
    found = Comparison(dict.fromkeys(QUANTITIES, 0.0), dict.fromkeys(QUANTITIES, 0.0), {}, None, True)

    def within(quantity: str, step: int, key: str, i: int | None) -> tuple[bool, float, float]:
        def pick(run: dict[str, Any]) -> torch.Tensor | None:
            if i is None:
                return torch.tensor(run["losses"][step], dtype=torch.float64)
            value: torch.Tensor | None = run[key][step][i]
            return value

        d, scale = difference(pick(other), pick(single))
        r = _relative(d, scale)
        found.max_abs[quantity] = max(found.max_abs[quantity], d)
        found.max_rel[quantity] = max(found.max_rel[quantity], r)
        if tolerance.rule == "fixed" or exact is None:
            return d <= tolerance.atol + tolerance.rtol * scale, d, r
        mine, exact_scale = difference(pick(other), pick(exact))
        theirs, _ = difference(pick(single), pick(exact))
        entitled = max(theirs, _FLOOR_EPS * tolerance.eps * exact_scale)
        units = mine / entitled if entitled else (0.0 if mine == 0 else float("inf"))
        found.rounding[quantity] = max(found.rounding.get(quantity, 0.0), units)
        return units <= FACTOR, d, r

    for step in range(len(single["losses"])):
        loss_ok, _, _ = within("loss", step, "losses", None)
        found.ok = found.ok and loss_ok
        for rank, name in enumerate(ranked, start=1):
            i = position[name]
            for quantity, key in (("gradient", "grads"), ("parameter", "params")):
                same, d, r = within(quantity, step, key, i)
                if not same:
                    found.ok = False
                    if found.first is None:
                        found.first = {
                            "step": step + 1,
                            "parameter": name,
                            "position": rank,
                            "quantity": quantity,
                            "abs": d,
                            "rel": r,
                        }
    return found
