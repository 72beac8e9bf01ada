"""Gradients no rank holds whole, guarded: any use of ``p.grad`` by code other than ours raises, naming the fix.

    guard = GradientGuard("zero2")
    guard.arm(params)        # after a synchronised backward: each p.grad is a placeholder without storage
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # ShardedGradientError: use par.clip_grad_norm_
    guard.disarm(params)     # before the next backward: p.grad is None again (or what we put back)

Under the sharded strategies a parameter's gradient lives in pieces across ranks (each rank holds its part of
every bucket, or of every unit). A plain ``p.grad`` would be ``None``, and torch's own utilities read ``None`` as
"no gradient": ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (nanoGPT's line) returns 0.0 and
clips nothing, a hand-written ``sum(p.grad.norm() ** 2 ...)`` skips every parameter, and an optimizer that was
never prepared steps nothing. Each of those trains another model, silently.

So after the synchronised backward every managed parameter's ``.grad`` is a :class:`ShardedGradient`: a tensor
of the parameter's shape, dtype and device with no storage, whose every operation raises
:class:`ShardedGradientError` with the strategy and what to call instead. Metadata (``shape``, ``dtype``,
``device``, ``is not None``) reads as for a real gradient, so code that only checks for a gradient keeps working;
setting ``.grad = None`` (``zero_grad()``) removes it. Placeholders cost no memory and are made once per
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from paratrain.errors import ConfigError

__all__ = ["GradientGuard", "ShardedGradient", "ShardedGradientError"]


class ShardedGradientError(ConfigError):
    """Code other than paratrain's used a gradient that the sharded strategies keep in pieces across ranks."""


class ShardedGradient(torch.Tensor):
    """A parameter's gradient held in pieces across ranks: metadata only; any operation on it raises."""

    _strategy: str
    _fixes: ClassVar[str] = (
        "par.clip_grad_norm_(model, max_norm) clips by the global norm, par.gradients(model) gives the whole "
        "gradients, and the optimizer par.prepare() returned steps them"
    )

    @staticmethod
    def __new__(cls, param: torch.Tensor, strategy: str) -> ShardedGradient:
        made = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        made._strategy = strategy
        return made  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        strategy = next((a._strategy for a in args if isinstance(a, ShardedGradient)), "a sharded strategy")
        op = getattr(func, "__name__", str(func)).split(".")[0]
        raise ShardedGradientError(
            f"under {strategy} no rank holds a parameter's whole gradient, so p.grad cannot be read or changed "
            f"(here by torch's {op}: torch.nn.utils.clip_grad_norm_, clip_grad_value_, a hand-written norm, or an "
            f"optimizer that par.prepare() did not return): {cls._fixes}"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, strategy={self._strategy!r})"


class GradientGuard:
    """The placeholders of one strategy's parameters, put into ``.grad`` and taken out again."""

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy
        self._placeholders: dict[int, ShardedGradient] = {}
        self._armed = False  # placeholders may be in .grad: disarm has work to do (every forward asks)

    def placeholder(self, param: torch.Tensor) -> ShardedGradient:
        made = self._placeholders.get(id(param))
        if made is None or made.shape != param.shape or made.dtype != param.dtype or made.device != param.device:
            made = self._placeholders[id(param)] = ShardedGradient(param, self.strategy)
        return made

    def arm(self, params: Iterable[torch.Tensor]) -> None:
        """Every parameter's ``.grad`` becomes its placeholder (where it has none of its own)."""
        self._armed = True
        for p in params:
            if p.requires_grad and (p.grad is None or isinstance(p.grad, ShardedGradient)):
                p.grad = self.placeholder(p)

    def disarm(self, params: Iterable[torch.Tensor]) -> None:
        """Every placeholder in ``.grad`` is taken out (``None``): autograd may accumulate into ``.grad`` again.

        Costs nothing when this guard armed none since it last disarmed (the forwards of no_sync, evaluation)."""
        if not self._armed:
            return
        self._armed = False
        for p in params:
            if isinstance(p.grad, ShardedGradient):
                p.grad = None

    @staticmethod
    def armed(param: torch.Tensor) -> bool:
        return isinstance(param.grad, ShardedGradient)
