"""The one interface every way of running implements; the training loop is written only against it.

A strategy owns where the model and batches live, how the model is wrapped, which part of a global batch this
process trains on, and the collectives a loop needs for metrics. The single-device and DataParallel
strategies run in one process, so their collectives are identities.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from paratrain.checkpoint.sharded import materialize
from paratrain.checkpoint.state_dicts import check_compatible
from paratrain.comm.meeting import Meeting
from paratrain.compiled import without_compiled
from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError

__all__ = ["ReduceOp", "Strategy"]

ReduceOp = Literal["sum", "mean", "max", "min"]


class Strategy(ABC):
    """How a training loop runs: one device, several in one process, or several processes."""

    name: ClassVar[str]
    shards_checkpoints: ClassVar[bool] = False  # a prepared model's or optimizer's state is each process's slices

    def __init__(self) -> None:
        # what wrap_model returned -> the user's model it wraps (the same object when nothing is put around it)
        self._wrapped: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        self.environment = ClusterEnvironment.detect()  # where a launcher put this process (rank 0 of 1 without)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where this process keeps the model and puts each batch."""

    @property
    @abstractmethod
    def devices(self) -> list[torch.device]:
        """Every device this process computes on."""

    @property
    def rank(self) -> int:
        """This process's index among all processes (0 in one process)."""
        return 0

    @property
    def world_size(self) -> int:
        """How many processes train together (1 in one process)."""
        return 1

    @property
    def is_main(self) -> bool:
        """True in the one process that prints, shows progress and writes files."""
        return self.rank == 0

    @property
    def meeting(self) -> Meeting | None:
        """Where this strategy's processes wait for each other outside collectives (None in one process)."""
        return None

    def setup(self) -> None:
        """Prepare the process (process groups, device selection); called once before anything else."""

    def teardown(self, clean: bool = True) -> None:
        """Release what :meth:`setup` took; safe to call twice.

        ``clean`` is False when leaving because of an error: nothing may then wait for other processes.
        """

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` and wrap it for this strategy; the strategy remembers what it wrapped.

        A model compiled before ``prepare`` (``torch.compile(model)``) is wrapped as it is: the wrapper's own work
        runs eagerly around the compiled model (:meth:`unwrap` gives the user's module inside).
        """
        wrapped = self._wrap(model)
        self._wrapped[wrapped] = model
        return wrapped

    @abstractmethod
    def _wrap(self, model: nn.Module) -> nn.Module:
        """What :meth:`wrap_model` puts around ``model`` (``model`` itself, moved, when nothing is needed)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside what :meth:`wrap_model` put around it; any other model as it is.

        Known from what this strategy wrapped, never guessed from attribute names: a user's model with a
        submodule called ``module`` is returned whole. ``torch.compile``'s wrapper, around the prepared model or
        around the user's model before ``prepare``, is seen through (:mod:`paratrain.compiled`): the module returned
        is the user's own, its state dict without ``_orig_mod.``.
        """
        plain = without_compiled(model)
        return without_compiled(self._wrapped.get(plain, plain))

    @contextmanager
    def full_weights(self, model: nn.Module) -> Iterator[nn.Module]:
        """The user's model with its whole weights inside the block (zero3 gathers them; the others hold them)."""
        yield self.unwrap(model)

    def prepared(self, model: nn.Module) -> bool:
        """True for a model :meth:`wrap_model` returned (or the user's model inside it), compiled or not."""
        plain = without_compiled(model)
        return plain in self._wrapped or any(plain is without_compiled(inner) for inner in self._wrapped.values())

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer a loop steps: ``optimizer`` itself, or under a sharded strategy one over this rank's shard."""
        return optimizer

    def gradients(self, model: nn.Module) -> list[torch.Tensor | None]:
        """Every parameter's synchronised gradient, whole, in ``parameters()`` order (for checks: may gather)."""
        return [p.grad for p in self.unwrap(model).parameters()]

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """What a checkpoint holds of ``model``: its state dict (a sharded strategy: this rank's slices)."""
        return self.unwrap(model).state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a checkpoint's model state, written under any strategy and world size (zero3: only its shards).

        Raises:
            CheckpointError: keys, shapes or dtypes that do not fit the model (checked before anything is written).
        """
        module = self.unwrap(model)
        check_compatible(module.state_dict(), state)
        module.load_state_dict(materialize(state))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a checkpoint holds of ``optimizer``: torch's state dict, indexed as the user's optimizer."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a checkpoint's optimizer state, written under any strategy and world size."""
        optimizer.load_state_dict(materialize(state))

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This process's part of a global batch of sample indices (all of it in one process)."""
        return indices

    def loss_weight(self, local_samples: int, global_samples: int) -> float:
        """Factor on this process's mean loss that makes the synchronised gradient the global batch's mean.

        In one process the local batch is the global batch, so the factor is 1.
        """
        return 1.0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``module``'s gradients to ``max_norm`` in total; returns the total norm before clipping.

        After synchronisation every process holds the whole gradient (in one process: the replicas' gradients
        summed into the module's), so the local norm is the global norm.
        """
        params = [p for p in module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Combine ``tensor`` across processes; in one process, the tensor itself."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every process's ``tensor``, in rank order."""
        return [tensor]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Process ``src``'s ``tensor`` in every process (a new tensor; in one process, the tensor itself)."""
        return tensor

    def barrier(self) -> None:
        """Wait until every process arrives."""

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation inside the block (gradient accumulation).

        Raises:
            ConfigError: ``model`` is not one this strategy prepared (there would be nothing to skip, silently).
        """
        self.check_prepared(model, "no_sync()")
        yield

    def check_prepared(self, model: nn.Module, what: str) -> None:
        """Raise ConfigError when ``model`` is not one this strategy prepared."""
        if not self.prepared(model):
            raise ConfigError(
                f"{what} got a {type(model).__name__} that this Parallel did not prepare, so it cannot control "
                f"its gradient synchronisation; pass the model that par.prepare(model) returned"
            )

    @property
    def collective_wait_seconds(self) -> float:
        """Seconds this process has spent waiting in collectives (0 in one process): a rank the others wait for
        (a straggler) waits least."""
        return 0.0

    def world_devices(self) -> list[str]:
        """Every device of every process, in rank order (this process's devices in one process)."""
        return [str(d) for d in self.devices]

    @contextmanager
    def init_module(self) -> Iterator[None]:
        """Where the model is built (``Parallel.init_module``): as written, on the CPU; zero3 records it on meta."""
        yield

    def describe(self) -> str:
        """A short label for logs and results, e.g. ``dp on cpu, cpu, cpu``."""
        return f"{self.name} on {', '.join(str(d) for d in self.devices)}"
