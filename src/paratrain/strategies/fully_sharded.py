"""``zero3``: one process per device as under ddp, with the weights, gradients and optimizer state all sharded.

A loop runs unchanged; the options are the strategy object's::

    par = Parallel("zero3")                                        # under paratrain launch / torchrun
    par = Parallel(Zero3Strategy(units=[Block], prefetch=2))       # the user's units, two all-gathers ahead
    model, optimizer, loader = par.prepare(model, optimizer, loader)   # optimizer: same class, this rank's shard
    par.save({"model": model, "optimizer": optimizer, "step": step}, "runs/a/step-100.pt")   # sharded checkpoint

The model must be prepared before (or in the same call as) its optimizer. The prepared model's ``state_dict()``
gathers whole tensors (a collective: every process calls it); ``par.save``/``par.load`` read and write each
process's shards only. A model built under ``torch.device("meta")`` is materialised by ``prepare``, unit by unit.
See :mod:`paratrain.sharded.fully_sharded`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from paratrain.checkpoint.lazy_weights import FileTensor
from paratrain.checkpoint.sharded import LocalSlices, StoredTensor, materialize
from paratrain.comm.collectives import DEFAULT_TIMEOUT_S, CollectiveMonitor
from paratrain.ddp.options import DDPOptions, Refusal
from paratrain.environment import ClusterEnvironment
from paratrain.errors import CheckpointError
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.sharded.init_record import InitRecord, record_init
from paratrain.sharded.optimizer import OwnedPiece
from paratrain.sharded.units import DEFAULT_MIN_PARAMS, UnitSpec
from paratrain.strategies.sharded import ShardedStrategy

__all__ = ["Zero3Strategy"]


def _went_on(gone: dict[int, str]) -> str:
    return "; ".join(f"rank {rank} {how}" for rank, how in sorted(gone.items()))


def _forward_everywhere(gone: dict[int, str]) -> str:
    """The refusal of a forward under no_grad that other ranks did not run (an evaluation on rank 0 only)."""
    return (
        f"a forward under torch.no_grad() that not every rank runs ({_went_on(gone)} instead): under zero3 each "
        "unit's weights are gathered from every rank for every forward, so an evaluation on one rank only would wait "
        "for the others forever. Evaluate on every rank (as nanoGPT's estimate_loss does), or take "
        "model.state_dict() on every rank and evaluate a plain copy of the model on the main process"
    )


def _gather_everywhere(what: str, gone: dict[int, str]) -> str:
    """The refusal of a gathering of the weights that not every rank joins (``if rank == 0: model.state_dict()``)."""
    return (
        f"{what} that not every rank calls ({_went_on(gone)} instead): under zero3 it gathers every unit's weights "
        "from every rank, so every rank calls it at the same point. Call it on every rank and let rank 0 alone write "
        "what it gives (state = model.state_dict(); if par.is_main: torch.save(state, path)), or save a checkpoint "
        "with par.save(...) on every rank"
    )


def _extra_forward(rank: int, sites: list[str], count: int, gone: dict[int, str]) -> str:
    """The refusal of a training forward (autograd on) that other ranks did not run (a loss looked at on rank 0
    without torch.no_grad(), an extra forward under ``if par.is_main:``)."""
    where = ", then at ".join(site or "(no line of yours)" for site in sites)
    earlier = "..., " if count > len(sites) else ""
    went_on = "; ".join(f"rank {peer} ran fewer and went on: it {how}" for peer, how in sorted(gone.items()))
    return (
        f"rank {rank}: a training forward (autograd on) that not every rank runs: rank {rank} ran {count} training "
        f"forwards without a backward between them, at {earlier}{where}, while {went_on}. Under zero3 every forward "
        "all-gathers each unit's weights from every rank, so every rank runs the same forwards in the same order: "
        "evaluate under torch.no_grad() on every rank, or take model.state_dict() on every rank and evaluate a plain "
        "copy of the model on the main process"
    )


class Zero3Strategy(ShardedStrategy):
    """Fully sharded data parallel across processes (module docstring).

    Args:
        device_type, timeout, environment, hang_report: as for :class:`DistributedStrategy`.
        options: :class:`~paratrain.ddp.options.DDPOptions`; zero3 has no buckets and no bucket reducer, and
            refuses every option set (:attr:`refused_options` says why, and what to use instead).
        units: module classes and qualified module names that become units (None: every block of a
            ``ModuleList``/``Sequential`` with at least ``min_params`` parameters; the root holds the rest).
        min_params: the default policy's smallest block.
        reshard_after_forward: release each unit's gathered weights after its forward (False: after its backward).
        prefetch: units gathered ahead of the one computing (0: none).
    """

    name: ClassVar[str] = "zero3"
    refused_options: ClassVar[dict[str, Refusal]] = {
        "find_unused_parameters": Refusal(
            "zero3 has no search for unused parameters: each unit reduces its gradients when its backward ends "
            "(parameters of the unit that got none take part with zeros), so every rank must run the same units",
            "use strategy ddp, zero1 or zero2 for find_unused_parameters, or drop it",
        ),
        "static_graph": Refusal(
            "zero3 has no bucket reducer to learn the graph: each unit reduces when its own backward ends",
            "drop static_graph (or use strategy ddp, zero1 or zero2)",
        ),
        "bucket_cap_mb": Refusal(
            "zero3 reduces gradients unit by unit (whole modules), not in buckets",
            "size the units with Zero3Strategy(units=..., min_params=...), or drop bucket_cap_mb",
        ),
        "gradient_as_bucket_view": Refusal(
            "zero3 keeps no whole gradient to view: each unit's is reduce-scattered and this rank keeps its part",
            "drop gradient_as_bucket_view, or use strategy ddp for whole gradients in .grad",
        ),
        "comm_hook": Refusal(
            "its gradients are reduce-scattered unit by unit, and a hook replaces an all-reduce",
            "use strategy ddp or zero1 for a hook, or drop the hook",
        ),
    }

    def __init__(
        self,
        device_type: str = "auto",
        *,
        units: UnitSpec | None = None,
        min_params: int = DEFAULT_MIN_PARAMS,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        timeout: float = DEFAULT_TIMEOUT_S,
        environment: ClusterEnvironment | None = None,
        hang_report: str | None = None,
        options: DDPOptions | None = None,
    ) -> None:
        super().__init__(
            device_type, timeout=timeout, environment=environment, hang_report=hang_report, options=options
        )
        self.units = list(units) if units is not None else None
        self.min_params = min_params
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self._sharded: list[FullyShardedDataParallel] = []
        self._records: list[InitRecord] = []

    def describe(self) -> str:
        return f"zero3, {self.world_size} processes, on {self._device.type}"

    @contextmanager
    def init_module(self) -> Iterator[None]:
        """The model built on the meta device, its construction recorded: ``prepare`` replays it unit by unit,
        each rank keeping its shards (paratrain.sharded.init_record), with a plain build's weights."""
        with record_init() as record:
            self._records.append(record)  # prepare finds it by the model's tensors (a weak registry)
            yield

    def _wrap(self, model: nn.Module) -> nn.Module:
        on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        if not on_meta:
            model = model.to(self._device)
        wrapped = FullyShardedDataParallel(
            model,
            self.units,
            min_params=self.min_params,
            reshard_after_forward=self.reshard_after_forward,
            prefetch=self.prefetch,
            device=self._device,
            timeout=self._timeout,
            hang_report=self._hang_report,
        )
        meeting = self.meeting
        if meeting is not None:
            ranks = range(self.world_size)
            # a rank waiting to gather the weights (every rank's model.state_dict() at the end, say) went on past a
            # meeting on one rank only (an evaluation, a save): that one is refused, and its rank comes to the gathering
            gathering = "zero3-gather-weights"
            meeting.launching[gathering] = "waits to gather the weights (a state dict, a load or par.full_weights)"
            wrapped.before_no_grad_forward = lambda: meeting.attend(
                "zero3-no-grad-forward",
                ranks,
                "a forward under torch.no_grad()",
                _forward_everywhere,
            )
            wrapped.before_gathering = lambda what: meeting.attend(
                gathering, ranks, what, lambda gone: _gather_everywhere(what, gone), value=f"gather for {what}"
            )
            monitor = wrapped.monitor
            wrapped.before_extra_forward = lambda sites, count: meeting.attend(
                "zero3-training-forward",
                ranks,
                "a training forward",
                lambda gone: _extra_forward(self.rank, sites, count, gone),
                error=lambda message: monitor.refusal(message, "a training forward that not every rank ran"),
                overdue=lambda missing: monitor.unmet_error("the all-gathers of a training forward", missing),
            )
        self._sharded.append(wrapped)
        return wrapped

    # -- what the ddp strategy finds among its DDP wrappers ----------------------------------------------------

    def monitors(self) -> list[CollectiveMonitor]:
        return [w.monitor for w in self._sharded] + super().monitors()

    def teardown(self, clean: bool = True) -> None:
        failure = self.failure  # read before the wrappers go: the ddp teardown then leaves a failed group alone
        for wrapped in self._sharded:
            wrapped.close()
        if failure is None:
            self._sharded.clear()
        super().teardown(clean)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self.check_prepared(model, "no_sync()")
        with self.wrapper_of(model, "no_sync()").no_sync():
            yield

    @contextmanager
    def full_weights(self, model: nn.Module) -> Iterator[nn.Module]:
        wrapper = self.wrapper_of(model, "full_weights()")
        with wrapper.full_weights():
            yield wrapper.module

    def wrappers(self) -> list[FullyShardedDataParallel]:
        return list(self._sharded)

    @staticmethod
    def trained(wrapper: FullyShardedDataParallel) -> list[torch.Tensor]:
        return list(wrapper.params)

    def wrapper_of(self, model: nn.Module, what: str) -> FullyShardedDataParallel:
        found: FullyShardedDataParallel = super().wrapper_of(model, what)
        return found

    # -- the optimizer ----------------------------------------------------------------------------------------

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        for wrapper in self._sharded:  # an optimizer built over a meta model: its parameters were replaced
            if wrapper.replaced:
                for group in optimizer.param_groups:
                    group["params"] = [wrapper.replaced.get(id(p), p) for p in group["params"]]
        return super().wrap_optimizer(optimizer)

    # -- the global gradient ----------------------------------------------------------------------------------

    def gradients(self, model: nn.Module) -> list[torch.Tensor | None]:
        wrapper = self.wrapper_of(model, "gradients()")
        whole = wrapper.full_gradients()
        return [whole.get(id(p)) for p in wrapper.module.parameters()]

    # -- checkpoints: every rank its own slices, unit by unit -------------------------------------------------

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's state dict with every parameter as this rank's slices of it (nothing gathered)."""
        wrapper = self.wrapper_of(model, "saving the model")
        mine: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for piece in wrapper.all_pieces():
            mine.setdefault(id(piece.param), []).append((piece.start, piece.value))
        with wrapper.sharded_state():
            state = wrapper.module.state_dict()
        for key, p in wrapper.module.named_parameters(remove_duplicate=False):
            if key in state:
                state[key] = LocalSlices(tuple(p.shape), p.dtype, list(mine.get(id(p), [])))
        return state

    def load_model_state(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        """Fill this rank's shards from a checkpoint's model state (any strategy's), reading only its slices; or
        from a weights file opened by :func:`~paratrain.checkpoint.lazy_weights.open_weights` (``--init-from``),
        reading one tensor of it at a time."""
        wrapper = self.wrapper_of(model, "loading the model")
        module = wrapper.module
        with wrapper.sharded_state():
            expected = set(module.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"the checkpoint's model state does not fit this model: missing {missing[:6]}, unexpected "
                f"{unexpected[:6]}; build the same model as the run that saved it"
            )
        key_of: dict[int, str] = {}
        for key, p in module.named_parameters(remove_duplicate=False):
            key_of.setdefault(id(p), key)  # a tied parameter: its first name (every name holds the same values)
        for key, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers()):
            shape = getattr(state.get(key), "shape", None)
            if shape is not None and tuple(shape) != tuple(t.shape):  # before any shard is written
                raise CheckpointError(
                    f"the checkpoint's {key} has shape {tuple(shape)}; this model's is {tuple(t.shape)}: build the "
                    f"same model as the run that saved it"
                )
        with torch.no_grad():
            for piece in wrapper.all_pieces():
                key = key_of[id(piece.param)]
                piece.value.copy_(_slice(state[key], piece, key))
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for key, value in state.items():
                if key in buffers:
                    buffers[key].copy_(value.full() if isinstance(value, FileTensor) else materialize(value))


def _slice(value: Any, piece: OwnedPiece, key: str) -> torch.Tensor:
    """Elements ``[piece.start, piece.start + length)`` of the saved tensor ``value`` (stored lazily, or whole)."""
    shape = tuple(piece.param.shape)
    if isinstance(value, StoredTensor | FileTensor):
        if tuple(value.shape) != shape:
            raise CheckpointError(f"the checkpoint's {key} has shape {value.shape}; this model's is {shape}")
        return value.read(piece.start, piece.length).to(piece.value.device)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"the checkpoint's {key} is {found}; this model's is a tensor of shape {shape}")
    return value.reshape(-1).narrow(0, piece.start, piece.length).to(piece.value.device)
