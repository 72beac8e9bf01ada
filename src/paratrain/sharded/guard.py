"""Gradients (and zero3's resting weights) no rank holds whole, guarded: any use by code other than ours raises,
naming the fix.

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

zero3's weights are the same case between the forwards that gather them: :func:`rest` leaves a parameter its
shape and no values, and any use of it but its metadata (an EMA over ``model.parameters()``, a copy, a load into a
submodule) raises :class:`ShardedWeightError`, naming ``par.full_weights(model)``; :func:`wake` gives it back its
gathered weights.

    rest(param, storage_free)     # between uses: param.detach().clone() raises ShardedWeightError
    wake(param, gathered_view)    # in a forward: the parameter as the user built it
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from paratrain.errors import ConfigError

__all__ = [
    "GradientGuard",
    "ShardedGradient",
    "ShardedGradientError",
    "ShardedWeight",
    "ShardedWeightError",
    "rest",
    "wake",
]


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
        raise _gradient_error(strategy, getattr(func, "__name__", str(func)).split(".")[0])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, strategy={self._strategy!r})"


def _gradient_error(strategy: str, op: str) -> ShardedGradientError:
    return ShardedGradientError(
        f"under {strategy} no rank holds a parameter's whole gradient, so p.grad cannot be read or changed "
        f"(here by torch's {op}: torch.nn.utils.clip_grad_norm_, clip_grad_value_, a hand-written norm, or an "
        f"optimizer that par.prepare() did not return): {ShardedGradient._fixes}"
    )


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


# -- zero3's weights between the uses that gather them ----------------------------------------------------------


class ShardedWeightError(ConfigError):
    """Code other than paratrain's read or wrote zero3's weights between the uses that gather them."""


_WEIGHT_FIX = (
    "read them whole inside `with par.full_weights(model) as module:` (every rank calls it, at the same point: it "
    "gathers every unit from every rank; rank 0 may then write what it read), or take model.state_dict() on every "
    "rank; after the Parallel closed the weights are gone: take them before"
)
# what a resting parameter answers as a whole one: metadata, gradient slots, hooks; ``data`` and ``detach`` give a
# :class:`ShardedWeight` (guarded alike); everything else raises
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "requires_grad_", "grad", "_grad", "grad_fn", "is_leaf",
        "numel", "nelement", "dim", "size", "ndim", "is_meta", "is_cuda", "is_cpu", "is_sparse", "is_quantized",
        "is_mkldnn", "is_nested", "layout", "nbytes", "itemsize", "element_size", "_version", "is_floating_point",
        "is_complex", "names", "name", "_base", "_is_view", "register_hook", "register_post_accumulate_grad_hook",
        "_post_accumulate_grad_hooks", "_backward_hooks", "retains_grad", "__repr__", "_is_param",
    }
)  # fmt: skip
_GUARDED_RESULT = frozenset({"data", "detach"})


def _name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name in ("__get__", "__set__", "__delete__"):  # a property: its descriptor's name
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return name


def _refuse(func: Any, cls: type) -> ShardedWeightError:
    return ShardedWeightError(
        f"under zero3 no rank holds a parameter's whole weights between the forwards that gather them: this one "
        f"holds none now (here used by torch's {_name(func)}: an EMA of the parameters, a copy, a histogram, "
        f"load_state_dict of a submodule); {_WEIGHT_FIX}"
    )


def _guarded(cls: type, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
    name = _name(func)
    if name not in _METADATA and name not in _GUARDED_RESULT:
        # a gradient's use beside the weights' (an optimizer never prepared): the gradient's error names its fix
        for arg in (*args, *(kwargs or {}).values()):
            for t in arg if isinstance(arg, list | tuple) else (arg,):
                if isinstance(t, ShardedGradient):
                    raise _gradient_error(t._strategy, name)
        raise _refuse(func, cls)
    if name == "__repr__":
        shown = args[0]
        return f"ShardedWeight(shape={tuple(shown.shape)}, dtype={shown.dtype}, zero3, between uses)"
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **(kwargs or {}))
    if name in _GUARDED_RESULT and isinstance(result, torch.Tensor):
        return result.as_subclass(ShardedWeight)
    return result


class ShardedWeight(torch.Tensor):
    """A tensor taken from a resting zero3 parameter (``p.detach()``, ``p.data``): metadata only, any use raises."""

    __torch_function__ = classmethod(_guarded)  # type: ignore[assignment,var-annotated]


_RESTING: dict[type, type] = {}  # a parameter's class -> its resting subclass


def _resting_class(cls: type) -> type:
    made = _RESTING.get(cls)
    if made is None:
        made = _RESTING[cls] = type(
            f"Resting{cls.__name__}", (cls,), {"__torch_function__": classmethod(_guarded), "__module__": __name__}
        )
    return made


def rest(param: torch.Tensor, data: torch.Tensor) -> None:
    """``param`` holds ``data`` (storage-free) and, until :func:`wake`, raises at any use but its metadata.

    HACK: the guard is the class: assigning ``__class__`` (to a subclass of the parameter's own class with a
    ``__torch_function__``) costs nothing at a forward, where :func:`wake` gives the class back, and a subclass
    of ``nn.Parameter`` stays one (isinstance, the module's registration). tests/test_zero3.py covers the reads."""
    param.data = data
    if type(param) not in _RESTING.values():
        param.__class__ = _resting_class(type(param))


def wake(param: torch.Tensor, data: torch.Tensor) -> None:
    """``param`` holds ``data`` (gathered weights) and is its own class again."""
    base = type(param)
    if base in _RESTING.values():
        param.__class__ = base.__mro__[1]
    param.data = data
