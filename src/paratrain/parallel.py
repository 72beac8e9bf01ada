"""``Parallel``: the few lines a training loop adopts to run on one device or many.

    par = paratrain.Parallel(strategy="auto", devices="auto")
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = criterion(model(x), y)
        par.backward(loss); optimizer.step(); optimizer.zero_grad()

The loop never asks which strategy it runs under: ``single`` (one device), ``dp`` (paratrain's DataParallel
over several devices in this process), and, with torchrun, ``ddp``. ``auto`` picks one by the rule in
:mod:`paratrain.strategies`.
"""

from __future__ import annotations

import builtins
import random
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import load_checkpoint, save_checkpoint
from .devices import DeviceLike
from .errors import ConfigError
from .prepared import BatchShare, PreparedIndexedLoader, PreparedLoader, prepare_loader
from .strategies import ReduceOp, Strategy, select_strategy
from .tree import flatten

__all__ = ["Parallel", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (CPU and every GPU) and, when installed, NumPy's generators."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a dependency, but the loop does not need it
        pass


class Parallel:
    """Run a training loop under a strategy chosen by name (or given as an object).

    Args:
        strategy: ``auto``, ``single``, ``dp`` (or ``ddp`` under torchrun), or a :class:`Strategy` instance
            (which brings its own devices and timeout).
        devices: ``auto`` (every GPU, or the CPU), a string such as ``cpu,cpu,cpu`` or ``cuda:0,cuda:1``, or a
            list of devices.
        seed: when given, seeds every generator the same way in every process.
        timeout: ddp only: seconds a collective may wait for the other ranks before failing.

    Raises:
        ConfigError: an unknown strategy, devices it cannot use, or ``devices``/``timeout`` given with a
            :class:`Strategy` instance (it has its own).
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        devices: str | Sequence[DeviceLike] | None = "auto",
        *,
        seed: int | None = None,
        timeout: float | None = None,
    ) -> None:
        if isinstance(strategy, Strategy):
            given = [
                f"{name}={value!r}"
                for name, value, default in (("devices", devices, "auto"), ("timeout", timeout, None))
                if value != default
            ]
            if given:
                raise ConfigError(
                    f"Parallel got a {type(strategy).__name__} object, which brings its own devices and timeout, "
                    f"and also {', '.join(given)}; pass them to the strategy's constructor instead"
                )
            self.strategy = strategy
        else:
            self.strategy = select_strategy(strategy, devices, timeout=timeout)
        self.strategy.setup()
        if seed is not None:
            seed_everything(seed)
        self._loaders: list[weakref.ref[PreparedLoader | PreparedIndexedLoader]] = []
        self._bound: BatchShare | None = None  # the share of the batch the latest training forward ran on

    # -- where we are -----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where this process's model and batches live."""
        return self.strategy.device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_main(self) -> bool:
        """True in the process that prints, shows progress and writes files."""
        return self.strategy.is_main

    @property
    def strategy_name(self) -> str:
        """``single``, ``dp`` or ``ddp``: what ``auto`` (or the name given) resolved to."""
        return self.strategy.name

    def describe(self) -> str:
        """A short label for logs and results, e.g. ``dp on cpu, cpu, cpu``."""
        return self.strategy.describe()

    def world_devices(self) -> list[str]:
        """Every device of every process, in rank order (a collective under ddp: call it in every process)."""
        return self.strategy.world_devices()

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This process's contiguous share of a 1-d tensor (the sample indices of a global batch, say)."""
        return self.strategy.shard(indices)

    # -- preparing the loop's objects -------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Wrap models, keep optimizers, and make loaders deliver this process's batches on :attr:`device`.

        Returns the prepared objects in the order given (one object: just that object).
        """
        prepared = tuple(self._prepare_one(obj) for obj in objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            wrapped = self.strategy.wrap_model(obj)
            if self.world_size > 1:  # one process holds the whole batch otherwise: every weight is 1
                wrapped.register_forward_pre_hook(self._bind_share, with_kwargs=True)
            return wrapped
        if isinstance(obj, torch.optim.Optimizer):
            return obj  # parameters moved in place by .to(), so the optimizer still holds the right ones
        if isinstance(obj, Iterable):
            loader = prepare_loader(obj, self.strategy)
            self._loaders.append(weakref.ref(loader))
            return loader
        raise ConfigError(
            f"prepare() takes models (nn.Module), optimizers and data loaders; found {type(obj).__name__}"
        )

    # -- the step ---------------------------------------------------------------------------------------------

    def _bind_share(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A prepared model's forward: the next backward weighs its loss by the share of the batch fed here.

        The batch is found among the prepared loaders' latest batches by identity; a batch changed on the way
        (``model(x.float())``) falls back to the latest batch any prepared loader yielded. Forwards without
        autograd (evaluation under ``torch.no_grad()``) bind nothing.
        """
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        recordings = [loader.recording for ref in self._loaders if (loader := ref()) is not None]
        fed = next((r for r in recordings if r.owns(tensors)), None)
        if fed is None and recordings:
            fed = max(recordings, key=lambda r: r.order)
        self._bound = fed.share if fed is not None else None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, weighted so that synchronised gradients are the global batch's mean gradient.

        The weight is this process's share of the global batch that the loss's forward ran on (see
        :meth:`_bind_share`); 1 in one process, or when the batch did not come from a prepared loader.
        """
        share, self._bound = self._bound, None
        weight = self.strategy.loss_weight(share.local, share.total) if share is not None and share.total else 1.0
        self.strategy.backward(loss if weight == 1.0 else loss * weight)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside it synchronises."""
        with self.strategy.no_sync(model):
            yield

    # -- helpers a loop needs ---------------------------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` in the main process only."""
        if self.is_main:
            builtins.print(*args, **kwargs)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Combine a metric across processes (the tensor itself in one process)."""
        return self.strategy.all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Process ``src``'s ``tensor`` in every process (the tensor itself in one process)."""
        return self.strategy.broadcast(tensor, src)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0 (the tensor itself in one process).

        Parts may differ in length along dim 0 (empty ones too); a 0-dim tensor counts as one entry.
        """
        parts = self.strategy.all_gather(tensor)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def barrier(self) -> None:
        self.strategy.barrier()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model, without the strategy's wrapper (its state_dict has no ``module.`` prefix)."""
        return self.strategy.unwrap(model)

    def save(self, state: dict[str, Any], path: str | Path) -> Path | None:
        """Write a training state atomically, from the main process only; every process waits for it."""
        target = Path(path)
        written = save_checkpoint(state, target.parent, target.name) if self.is_main else None
        self.barrier()
        return written

    def load(self, path: str | Path) -> dict[str, Any]:
        """Read a training state written by :meth:`save`, tensors mapped onto this process's device."""
        return load_checkpoint(path, map_location=self.device)

    def close(self, clean: bool = True) -> None:
        """Release the strategy's resources (threads, process groups).

        ``clean=False`` (leaving on an error) skips waiting for the other processes.
        """
        self.strategy.teardown(clean)

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(clean=exc_type is None)
