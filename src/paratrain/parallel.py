"""``Parallel``: the few lines a training loop adopts to run on one device or many.

    par = paratrain.Parallel(strategy="auto", devices="auto")
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = criterion(model(x), y)
        par.backward(loss); optimizer.step(); optimizer.zero_grad()

The loop never asks which strategy it runs under: ``single`` (one device), ``dp`` (paratrain's DataParallel
over several devices in this process), and, with torchrun, ``ddp``.
"""

from __future__ import annotations

import builtins
import random
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import load_checkpoint, save_checkpoint
from .devices import DeviceLike
from .errors import ConfigError
from .loader import DeviceLoader
from .prepared import BatchSizes, PreparedDeviceLoader, PreparedLoader
from .strategies import ReduceOp, Strategy, select_strategy

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
        strategy: ``auto``, ``single``, ``dp`` (or ``ddp`` under torchrun), or a :class:`Strategy` instance.
        devices: ``auto`` (every GPU, or the CPU), a string such as ``cpu,cpu,cpu`` or ``cuda:0,cuda:1``, or a
            list of devices.
        seed: when given, seeds every generator the same way in every process.
        timeout: ddp only: seconds a collective may wait for the other ranks before failing.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        devices: str | Sequence[DeviceLike] | None = "auto",
        *,
        seed: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.strategy = (
            strategy if isinstance(strategy, Strategy) else select_strategy(strategy, devices, timeout=timeout)
        )
        self.strategy.setup()
        if seed is not None:
            seed_everything(seed)
        self.batch_sizes = BatchSizes()  # the latest batch's local and global sample counts

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

    # -- preparing the loop's objects -------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Wrap models, keep optimizers, and make loaders deliver this process's batches on :attr:`device`.

        Returns the prepared objects in the order given (one object: just that object).
        """
        prepared = tuple(self._prepare_one(obj) for obj in objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return self.strategy.wrap_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return obj  # parameters moved in place by .to(), so the optimizer still holds the right ones
        if isinstance(obj, DeviceLoader):
            return PreparedDeviceLoader(obj, self.strategy, self.batch_sizes)
        if isinstance(obj, Iterable):
            return PreparedLoader(obj, self.strategy, self.batch_sizes)
        raise ConfigError(
            f"prepare() takes models (nn.Module), optimizers and data loaders; found {type(obj).__name__}"
        )

    # -- the step ---------------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, weighted so that synchronised gradients are the global batch's mean gradient."""
        weight = (
            self.strategy.loss_weight(self.batch_sizes.local, self.batch_sizes.total) if self.batch_sizes.total else 1.0
        )
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

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0 (the tensor itself in one process)."""
        parts = self.strategy.all_gather(tensor)
        return parts[0] if len(parts) == 1 else torch.cat([p.reshape(-1, *tensor.shape[1:]) for p in parts])

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
