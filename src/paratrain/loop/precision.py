"""Numeric precision of a training loop: one small object per choice, as ``Parallel(precision=...)`` uses them.

    precision = select_precision("bf16-mixed", torch.device("cpu"))
    with precision.autocast():                 # forward passes: matmuls in bfloat16, reductions in float32
        loss = criterion(model(x), y)
    precision.scale(loss).backward()           # 16-mixed: the loss times the scaler's scale; otherwise the loss
    precision.unscale([optimizer])             # before clipping (16-mixed); a no-op otherwise
    precision.step([optimizer])                # False when 16-mixed skipped the step (inf/nan gradients)

- ``32``: float32 everywhere, nothing changes (the default).
- ``bf16-mixed``: forward passes under ``torch.autocast`` with bfloat16; parameters, gradients and optimizer
  state stay float32. bfloat16 has float32's range, so no loss scaling is needed.
- ``16-mixed``: autocast with float16, plus a gradient scaler (``torch.amp.GradScaler``): the loss is scaled
  up so small gradients survive float16's range, gradients are unscaled before clipping and before the step,
  and a step whose gradients hold inf or nan is skipped (and counted) while the scale backs off.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from paratrain.errors import ConfigError
from paratrain.tree import map_tensors

__all__ = ["PRECISIONS", "FullPrecision", "HalfMixed", "MixedPrecision", "Precision", "select_precision"]

PRECISIONS = ("32", "bf16-mixed", "16-mixed")


class Precision:
    """Full float32: every method is the plain thing (the interface the mixed precisions refine)."""

    name: ClassVar[str] = "32"
    dtype: ClassVar[torch.dtype | None] = None  # the autocast dtype; None: no autocast

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.skipped_steps = 0  # optimizer steps skipped because gradients were not finite (16-mixed only)

    @property
    def scaled(self) -> bool:
        """True when gradients carry a loss scale until :meth:`unscale` (the optimizer must step through us)."""
        return False

    def autocast(self) -> AbstractContextManager[Any]:
        """The context forward passes run in."""
        return nullcontext()

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        """Make every forward of ``module`` run in :meth:`autocast`, its output through :meth:`convert_output`."""
        return []

    def convert_output(self, output: Any) -> Any:
        """A model's output as the loop sees it (mixed precisions: low-precision floats back to float32)."""
        return output

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on."""
        return loss

    def unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Divide the gradients these optimizers hold by the loss scale (once per step; later calls do nothing)."""

    def step(self, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        """Step every optimizer; False when the step was skipped (its gradients were not finite)."""
        for optimizer in optimizers:
            optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must carry to resume exactly."""
        return {"name": self.name, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


class FullPrecision(Precision):
    """``32``: float32 everywhere."""


class MixedPrecision(Precision):
    """``bf16-mixed``: forward passes under autocast to bfloat16; no loss scaling."""

    name: ClassVar[str] = "bf16-mixed"
    dtype: ClassVar[torch.dtype | None] = torch.bfloat16

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        _check_autocast(self.name, device_type, self._dtype)

    @property
    def _dtype(self) -> torch.dtype:
        assert self.dtype is not None
        return self.dtype

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self._dtype)

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        hooks = _AutocastHooks(self)
        # first among the pre-hooks, and the exit hook runs even when forward raises: autocast never leaks
        return [
            module.register_forward_pre_hook(hooks.enter, prepend=True),
            module.register_forward_hook(hooks.exit, always_call=True),
        ]

    def convert_output(self, output: Any) -> Any:
        # the loss is computed outside the model, outside autocast: in float32, as the parameters are
        return map_tensors(lambda t: t.float() if t.dtype == self.dtype else t, output)


class HalfMixed(MixedPrecision):
    """``16-mixed``: autocast to float16, with a gradient scaler."""

    name: ClassVar[str] = "16-mixed"
    dtype: ClassVar[torch.dtype | None] = torch.float16

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type)
        self.scaler = torch.amp.GradScaler(device_type)
        self._unscaled: set[int] = set()  # optimizers (by id) unscaled since the last step

    @property
    def scaled(self) -> bool:
        return True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.scaler.scale(loss)
        return scaled

    def unscale(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            if id(optimizer) not in self._unscaled:
                self.scaler.unscale_(optimizer)  # also records whether its gradients are finite
                self._agree(optimizer)
                self._unscaled_elsewhere(optimizer)
                self._unscaled.add(id(optimizer))

    def _agree(self, optimizer: torch.optim.Optimizer) -> None:
        """A sharded optimizer saw only its process's gradients: make the inf/nan finding every process's.

        HACK: the scaler keeps its findings per optimizer in ``_per_optimizer_states`` (private, stable since
        torch 1.6); tests/test_zero.py checks that a step overflowing on one rank's shard is skipped on all.
        """
        agree = getattr(optimizer, "agree_found_inf", None)
        if agree is not None:
            agree(self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _unscaled_elsewhere(self, optimizer: torch.optim.Optimizer) -> None:
        """A sharded optimizer's gradients were unscaled in this process's pieces: the strategy divides by the same
        scale what it holds beyond them (zero1's whole gradients, zero2's whole-gradient norms), so that the norm
        a clip measures is of unscaled gradients, as under ddp."""
        unscaled = getattr(optimizer, "gradients_unscaled", None)
        if unscaled is not None:
            # the scaler's own factor: the scale's reciprocal in float64, as float32 (exact: scales are powers of 2)
            unscaled(torch.tensor(1.0 / self.scaler.get_scale(), dtype=torch.float64).float())

    def step(self, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        # every optimizer steps on the same scale; the scale then changes once (several optimizers per step
        # must come in one call)
        before = self.scaler.get_scale()
        optimizers = list(optimizers)
        self.unscale(optimizers)  # here, not inside scaler.step: a sharded optimizer's finding is made global
        for optimizer in optimizers:
            self.scaler.step(optimizer)  # skips the step when a gradient is inf/nan
        self.scaler.update()  # backs the scale off after a skipped step, grows it after a run of good ones
        self._unscaled.clear()
        # update() lowers the scale exactly when some optimizer found an inf/nan gradient: the step was skipped
        skipped = self.scaler.get_scale() < before
        self.skipped_steps += int(skipped)
        return not skipped

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class _AutocastHooks:
    """Enter the precision's autocast before a module's forward, leave it after (per thread, nesting allowed)."""

    def __init__(self, precision: Precision) -> None:
        self.precision = precision
        self._local = threading.local()

    def _open(self) -> list[AbstractContextManager[Any]]:
        if not hasattr(self._local, "open"):
            self._local.open = []
        opened: list[AbstractContextManager[Any]] = self._local.open
        return opened

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        context = self.precision.autocast()
        context.__enter__()
        self._open().append(context)

    def exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        opened = self._open()
        if opened:
            opened.pop().__exit__(None, None, None)
        return None if output is None else self.precision.convert_output(output)


_BY_NAME: dict[str, type[Precision]] = {"32": FullPrecision, "bf16-mixed": MixedPrecision, "16-mixed": HalfMixed}


def select_precision(name: str, device: torch.device) -> Precision:
    """The precision called ``name`` for forward passes on ``device``'s type.

    Raises:
        ConfigError: an unknown name, or a mixed precision this device type (or this torch) cannot run.
    """
    kind = _BY_NAME.get(str(name))
    if kind is None:
        raise ConfigError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}")
    return kind(device.type)


def _check_autocast(name: str, device_type: str, dtype: torch.dtype) -> None:
    """Refuse a precision autocast would silently ignore on this device type (torch warns and disables it)."""
    problem = None
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        problem = "this GPU has no bfloat16 support"
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autocast(device_type, dtype=dtype):
                    active = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype
            except (RuntimeError, ValueError) as exc:
                active, caught = False, [warnings.WarningMessage(str(exc), RuntimeWarning, "", 0)]
        if not active:
            reason = "; ".join(str(w.message) for w in caught) or "autocast stays disabled"
            problem = f"torch {torch.__version__} cannot autocast to {dtype} on {device_type} ({reason})"
    if problem is not None:
        other = "bf16-mixed or 32" if name == "16-mixed" else "16-mixed or 32"
        raise ConfigError(f"precision {name!r} on {device_type}: {problem}; use precision {other}")
