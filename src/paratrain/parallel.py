"""``Parallel``: the few lines a training loop adopts to run on one device or many.

    par = paratrain.Parallel(strategy="auto", devices="auto")
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = criterion(model(x), y)
        par.backward(loss); optimizer.step(); optimizer.zero_grad()

The loop never asks which strategy it runs under: ``single`` (one device), ``dp`` (paratrain's DataParallel
over several devices in this process), and, with torchrun, ``ddp``. ``auto`` picks one by the rule in
:mod:`paratrain.strategies`. Mixed precision, gradient accumulation and clipping compose with every strategy::

    par = paratrain.Parallel("auto", precision="bf16-mixed")      # or "16-mixed" (with a gradient scaler)
    for batch in loader:                                          # one global batch per optimizer step
        for x, y in par.accumulate(model, batch, steps=4):        # only the last micro-batch synchronises
            par.backward(criterion(model(x), y))
        par.clip_grad_norm_(model, 1.0)                           # the global gradient's norm
        par.step(optimizer); optimizer.zero_grad()                # skipped (and counted) on inf/nan with 16-mixed
"""

from __future__ import annotations

import builtins
import random
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from paratrain.ddp.comm_hooks import CommHook
from paratrain.ddp.options import DDPOptions
from paratrain.devices import DeviceLike
from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError
from paratrain.loop.accumulation import check_steps, cut, micro_sizes, samples_in
from paratrain.loop.checkpoint_io import load_state, save_state
from paratrain.loop.contract import Contract, params_of
from paratrain.loop.precision import Precision, select_precision
from paratrain.loop.prepared import BatchLedger, PreparedIndexedLoader, PreparedLoader, Recording, prepare_loader
from paratrain.strategies import ReduceOp, Strategy, select_strategy
from paratrain.tree import flatten
from paratrain.user_keys import UserKeys

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
        strategy: ``auto``, ``single``, ``dp`` (or, under torchrun, ``ddp``, ``zero1``, ``zero2``, ``zero3``), or a
            :class:`Strategy` instance (which brings its own devices, timeout and DDP options).
        devices: ``auto`` (every GPU, or the CPU), a string such as ``cpu,cpu,cpu`` or ``cuda:0,cuda:1``, or a
            list of devices.
        seed: when given, seeds every generator the same way in every process.
        timeout: ddp only: seconds a collective may wait for the other ranks before failing.
        hang_report: ddp only: where the report of every rank goes (JSON) when a collective times out or ranks
            call different collectives (default ``paratrain-hang-report.json`` here; see docs/hangs.md).
        precision: ``32`` (default), ``bf16-mixed`` or ``16-mixed``: forward passes of prepared models run under
            ``torch.autocast`` for the device's type and return float32 outputs; ``16-mixed`` adds a gradient
            scaler (see :mod:`paratrain.loop.precision`), so optimizers must step through :meth:`step`.
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view, comm_hook, comm_state:
            DDP's options, as for :class:`~paratrain.DistributedDataParallel` (``comm_hook`` is registered with
            ``comm_state`` on every prepared model), gathered in a :class:`~paratrain.DDPOptions`. ``ddp``
            honours them all; ``zero1``, ``zero2`` and ``zero3`` honour some and refuse the others by name (the
            table in docs/ddp.md); ``single`` and ``dp`` refuse any of them; ``auto`` passes them on when it
            picks ``ddp`` and leaves them unused otherwise, so one script runs alone and under a launcher::

                par = Parallel("ddp", find_unused_parameters=True, bucket_cap_mb=50)

    Raises:
        ConfigError: an unknown strategy or precision, devices it cannot use (or a mixed precision they cannot
            run), ``devices``/``timeout``/a DDP option given with a :class:`Strategy` instance (it has its own),
            or a DDP option the strategy refuses (before any process group is set up).
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        devices: str | Sequence[DeviceLike] | None = "auto",
        *,
        seed: int | None = None,
        timeout: float | None = None,
        precision: str = "32",
        hang_report: str | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = True,
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
    ) -> None:
        options = DDPOptions(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            comm_hook=comm_hook,
            comm_state=comm_state,
        )
        if isinstance(strategy, Strategy):
            given = [
                f"{name}={value!r}"
                for name, value, default in (
                    ("devices", devices, "auto"),
                    ("timeout", timeout, None),
                    ("hang_report", hang_report, None),
                )
                if value != default
            ] + [options.shown(name) for name in options.given()]
            if given:
                raise ConfigError(
                    f"Parallel got a {type(strategy).__name__} object, which brings its own devices, timeout and "
                    f"DDP options, and also {', '.join(given)}; pass them to the strategy's constructor instead "
                    f"(DDP's options as options=paratrain.DDPOptions(...))"
                )
            self.strategy = strategy
        else:
            self.strategy = select_strategy(
                strategy, devices, timeout=timeout, hang_report=hang_report, options=options
            )
        self.strategy.setup()
        try:
            self.precision: Precision = select_precision(precision, self.strategy.device)
        except ConfigError:
            self.strategy.teardown(clean=False)
            raise
        if seed is not None:
            seed_everything(seed)
        self._loaders: list[weakref.ref[PreparedLoader | PreparedIndexedLoader]] = []
        self._ledger = BatchLedger()  # the batches this Parallel's loaders yielded; the share a backward weighs by
        self._micro = Recording(self._ledger)  # the micro-batch accumulate() is feeding
        self._warned_unmatched = False
        self._forward_ran = False  # a prepared model ran forward with autograd: backward has a loss of ours
        self._first_forward: list[RemovableHandle] = []  # one process: the hooks that watch for that forward
        self._contract = Contract()  # prepare() once, par.backward() before a step, synchronised gradients
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._trains: dict[int, set[int]] = {}  # a prepared optimizer (by id) -> the model parameters it trains
        self._handles: list[RemovableHandle] = []
        self._no_sync_depth = 0
        self._stepping = False  # inside step(): the optimizers' own step() is expected

    # -- where we are -----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where this process's model and batches live."""
        return self.strategy.device

    @property
    def environment(self) -> ClusterEnvironment:
        """Where a launcher put this process: rank, restarts, the job's id (rank 0 of 1 without a launcher)."""
        return self.strategy.environment

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

    def describe(self, *, loaders: bool = False) -> str:
        """A short label for logs and results, e.g. ``dp on cpu, cpu, cpu``.

        ``loaders=True`` adds how each prepared loader makes its batches: indexed on the device (paratrain's
        loader, or a DataLoader over a TensorDataset), or iterated as given and why.
        """
        label = self.strategy.describe()
        if loaders:
            live = [loader for ref in self._loaders if (loader := ref()) is not None]
            label += "".join(f"\nloader {i}: {loader.path}" for i, loader in enumerate(live, start=1))
        return label

    @property
    def collective_wait_seconds(self) -> float:
        """Seconds this process has spent waiting for the other processes in collectives (0 in one process)."""
        return self.strategy.collective_wait_seconds

    def world_devices(self) -> list[str]:
        """Every device of every process, in rank order (a collective under ddp: call it in every process)."""
        return self.strategy.world_devices()

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This process's contiguous share of a 1-d tensor (the sample indices of a global batch, say)."""
        return self.strategy.shard(indices)

    # -- preparing the loop's objects -------------------------------------------------------------------------

    @contextmanager
    def init_module(self) -> Iterator[None]:
        """Build the model inside it: as written under every strategy but zero3, where it is built on the meta
        device and its construction recorded (every ``reset_parameters()``, ``apply(init)``, ``torch.ones``), then
        replayed by :meth:`prepare` unit by unit with the same random draws, so the whole model never exists on
        one rank and its weights are a plain build's; the generator ends where a plain build leaves it::

            with par.init_module():
                model = GPT(config)
            model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters()))
        """
        with self.strategy.init_module():
            yield

    def prepare(self, *objects: Any) -> Any:
        """Wrap models, keep optimizers, and make loaders deliver this process's batches on :attr:`device`.

        A prepared model's forwards run in the precision's autocast; a prepared optimizer refuses to step on
        gradients that are not synchronised yet, or (``16-mixed``) still scaled. Returns the prepared objects in
        the order given (one object: just that object).
        """
        for i, obj in enumerate(objects):
            self._contract.check_not_prepared(obj, objects[:i])
        prepared = tuple(self._prepare_one(obj) for obj in objects)
        for obj, result in zip(objects, prepared, strict=True):
            self._contract.took(obj, result)
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare_one(self, obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            wrapped = self.strategy.wrap_model(obj)
            if isinstance(wrapped, UserKeys):  # its state_dict() has the user's keys, as the model's own
                wrapped.user_keys = True
            # the hooks run eagerly under torch.compile (a model compiled after prepare): our bookkeeping stays out
            # of the user's graph, dynamo breaks it there instead of tracing into a loader's recording
            if self.world_size > 1:  # in one process every loss weighs 1: nothing to find out per forward
                bind = torch.compiler.disable(self._bind_share)
                self._handles.append(wrapped.register_forward_pre_hook(bind, with_kwargs=True))
            elif not self._forward_ran:  # one process: only the first forward is watched (backward's check)
                note = torch.compiler.disable(self._note_first_forward)
                self._first_forward.append(wrapped.register_forward_pre_hook(note))
            self._handles += self.precision.attach(wrapped)
            return wrapped
        if isinstance(obj, torch.optim.Optimizer):
            # parameters moved in place by .to(), so the optimizer still holds the right ones; a sharded strategy
            # returns one of the same class over this process's shard
            trains = {id(p) for p in params_of(obj)}  # the user's parameters (a sharded strategy shards obj in place)
            prepared = self.strategy.wrap_optimizer(obj)
            self._optimizers.append(weakref.ref(prepared))
            self._trains[id(prepared)] = trains
            self._contract.stepped(prepared)
            self._handles.append(prepared.register_step_pre_hook(self._before_step))
            return prepared
        if isinstance(obj, Iterable):
            loader = prepare_loader(obj, self.strategy, self._ledger)
            self._loaders.append(weakref.ref(loader))
            return loader
        raise ConfigError(
            f"prepare() takes models (nn.Module), optimizers and data loaders; found {type(obj).__name__}"
        )

    # -- the step ---------------------------------------------------------------------------------------------

    def _note_first_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """In one process: a prepared model ran forward with autograd; the hooks go, so later steps cost nothing."""
        if torch.is_grad_enabled():
            self._forward_ran = True
            for handle in self._first_forward:
                handle.remove()
            self._first_forward.clear()

    def _bind_share(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A prepared model's forward: the next backward weighs its loss by the share of the batch fed here.

        The batch is found among the prepared loaders' latest batches by identity; a batch changed on the way
        (``model(x.float())``) falls back to the latest batch any prepared loader yielded (with a warning, once,
        when several loaders could have fed it). Forwards without autograd (evaluation under
        ``torch.no_grad()``) bind nothing.
        """
        if not torch.is_grad_enabled():
            return
        self._forward_ran = True
        recordings = self._recordings()
        fed = self._recording_of((args, kwargs), recordings)
        if fed is None and recordings:
            fed = max(recordings, key=lambda r: r.order)
            live = [r for r in recordings if r.order]
            if len(live) > 1 and not self._warned_unmatched:
                self._warned_unmatched = True
                warnings.warn(
                    "a prepared model's forward got a batch that no prepared loader yielded unchanged, while "
                    f"{len(live)} prepared loaders are alive; its loss is weighted by the latest loader's batch. "
                    "Feed the model the tensors the loader yielded (convert them inside the model), or prepare "
                    "only the loader you train on",
                    stacklevel=3,
                )
        # the values, not the recording: a loader may record its next batch before this forward's backward
        if fed is not None:
            self._ledger.bind(fed.share, fed.fraction)
        else:
            self._ledger.unbind()

    def _recordings(self) -> list[Recording]:
        loaders = [loader.recording for ref in self._loaders if (loader := ref()) is not None]
        return [self._micro, *loaders] if self._micro.order else loaders

    @staticmethod
    def _recording_of(batch: Any, recordings: list[Recording]) -> Recording | None:
        """The recording whose latest batch holds one of ``batch``'s tensors (fed unchanged), if any."""
        if type(batch) is tuple and len(batch) == 2 and type(batch[0]) is tuple:  # a forward's (args, kwargs)
            direct = [a for a in batch[0] if isinstance(a, torch.Tensor)]  # the common case: model(x)
            found = next((r for r in recordings if r.owns(direct)), None) if direct else None
            if found is not None:
                return found
        tensors = [t for t in flatten(batch)[0] if isinstance(t, torch.Tensor)]
        return next((r for r in recordings if r.owns(tensors)), None)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, weighted so that synchronised gradients are the global batch's mean gradient.

        The weight is this process's share of the global batch that the loss's forward ran on (see
        :meth:`_bind_share`), times the micro-batch's part of that share under :meth:`accumulate`; 1 in one
        process without accumulation, or when the batch did not come from a prepared loader. With ``16-mixed``
        the weighted loss is also multiplied by the gradient scaler's scale.

        Raises:
            ConfigError: no model :meth:`prepare` returned has run forward: the loss comes from a model no
                strategy prepared, whose gradients would never be synchronised.
        """
        if not self._forward_ran:
            raise ConfigError(
                "par.backward() got a loss, but no model that par.prepare() returned has run forward: the loss "
                "comes from a model this Parallel did not prepare, so its gradients are never synchronised (under "
                "ddp every process would train its own copy). Call model = par.prepare(model) (with the optimizer "
                "and the loader) and compute the loss with the model it returns"
            )
        share, fraction = self._ledger.take()
        weight = self.strategy.loss_weight(share.local, share.total) if share is not None and share.total else 1.0
        weight *= fraction
        self.strategy.backward(self.precision.scale(loss if weight == 1.0 else loss * weight))
        self._contract.backward_done(local=self._no_sync_depth > 0)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next backward outside it synchronises."""
        self._no_sync_depth += 1
        try:
            with self.strategy.no_sync(model):
                yield
        finally:
            self._no_sync_depth -= 1

    def accumulate(self, model: nn.Module, batch: Any, steps: int) -> Iterator[Any]:
        """Cut ``batch`` into up to ``steps`` micro-batches and yield each; only the last one synchronises.

        Run forward and :meth:`backward` on each micro-batch in the loop's body; after the loop the gradients
        are the global batch's mean, synchronised once (one all-reduce round under ddp), ready for
        :meth:`clip_grad_norm_` and :meth:`step`. ``batch`` is what a prepared loader yielded (this process's
        share of a global batch); the rule for the cut is in :mod:`paratrain.loop.accumulation`. ``steps=1`` yields
        ``batch`` itself.

        Raises:
            ConfigError: ``steps`` is not a positive int, or the batch has no tensor to cut along dim 0.
        """
        check_steps(steps)
        if steps == 1:
            yield batch
            return
        fed = self._recording_of(batch, self._recordings())
        share = fed.share if fed is not None else None
        local = samples_in(batch)
        # every process must cut into the same number of micro-batches: known from the global batch's size, or
        # in one process from this batch; otherwise (ddp, a batch from no prepared loader) exactly ``steps``
        total = share.total if share is not None else (local if self.world_size == 1 else None)
        sizes = micro_sizes(local, total, steps)
        try:
            for k, (piece, n) in enumerate(zip(cut(batch, sizes), sizes, strict=True)):
                fraction = n / local if local else 0.0
                self._micro.record(piece, share, fraction)
                self._ledger.bind(share, fraction)  # for the piece's backward (a forward may bind it again)
                if k + 1 < len(sizes):
                    with self.no_sync(model):
                        yield piece
                else:
                    yield piece
        finally:
            self._micro.clear()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient of ``model`` to ``max_norm``; returns its norm before clipping.

        Call it after the last backward of a step (outside ``no_sync``): the norm is then that of the
        synchronised gradient, the same in every process and equal to one device's. With ``16-mixed`` the
        gradients are unscaled first (through the prepared optimizer holding them).

        Raises:
            ConfigError: the latest backward ran inside ``no_sync`` (gradients not synchronised yet), or
                ``16-mixed`` and no prepared optimizer holds the model's parameters.
        """
        self._contract.check_synchronised("clip_grad_norm_()")
        module = self.unwrap(model)
        if self.precision.scaled:
            params = {id(p) for p in module.parameters()}
            holding = [opt for opt in self._live_optimizers() if params & self._trains.get(id(opt), set())]
            if not holding:
                raise ConfigError(
                    f"clip_grad_norm_() under precision {self.precision.name!r} unscales the gradients first, "
                    f"through the optimizer that holds them, but no optimizer given to prepare() holds this "
                    f"model's parameters; pass the optimizer to prepare() too"
                )
            self.precision.unscale(holding)
        return self.strategy.clip_grad_norm_(module, max_norm, norm_type)

    def gradients(self, model: nn.Module) -> list[torch.Tensor | None]:
        """Every parameter's synchronised gradient, whole, in ``parameters()`` order (None where there is none).

        Under single, dp and ddp, each ``.grad``; under zero2 and zero3 no process holds a whole gradient, so they are
        gathered from every process's shard (a collective: call it in every process), for checks such as
        ``paratrain verify``.
        """
        return self.strategy.gradients(model)

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` for each, through the precision: False when the step was skipped.

        Only ``16-mixed`` skips steps (a gradient was inf or nan: the scale backs off and
        ``par.precision.skipped_steps`` counts it); it also needs every optimizer of a step in one call, since
        the scale changes once per step. Under ``32`` and ``bf16-mixed``, ``optimizer.step()`` does the same.
        """
        if not optimizers:
            raise ConfigError("step() takes the optimizer(s) to step, e.g. par.step(optimizer)")
        self._contract.check_synchronised("step()")
        self._stepping = True
        try:
            return self.precision.step(optimizers)
        finally:
            self._stepping = False

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """A prepared optimizer's step pre-hook: refuse steps that would apply the wrong gradients."""
        self._contract.before_step(optimizer, args, kwargs)
        if self.precision.scaled and not self._stepping:
            raise ConfigError(
                f"under precision {self.precision.name!r} the gradients carry the loss scale: step with "
                f"par.step(optimizer), which unscales them and skips steps with inf/nan gradients, instead of "
                f"optimizer.step()"
            )
        self._contract.stepped(optimizer)  # a step refused above did not happen

    def _live_optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for ref in self._optimizers if (opt := ref()) is not None]

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

    @contextmanager
    def full_weights(self, model: nn.Module) -> Iterator[nn.Module]:
        """The user's model with its whole weights inside the block, for reads between steps (an EMA, a copy)::

            with par.full_weights(model) as module:
                for e, p in zip(ema.parameters(), module.parameters()):
                    e.lerp_(p, 0.001)

        Under zero3 no rank holds whole weights between forwards (a parameter's use outside a forward or this block
        raises, naming it): the block gathers every unit from every rank (a collective: every rank enters it at the
        same point), and what is written into the weights inside is kept. Under the other strategies every rank
        holds the weights and the block only gives the module.
        """
        with self.strategy.full_weights(model) as module:
            yield module

    def save(self, state: dict[str, Any], path: str | Path) -> Path | None:
        """Write a training state atomically; every process calls it and waits for it.

        Values that are prepared models or optimizers are saved as the strategy holds them: their state dicts
        (written by the main process), or under ``zero1``/``zero2``/``zero3`` each process's slices of them, written by
        each process into a sharded checkpoint: the directory ``path`` without ``.pt``
        (:mod:`paratrain.checkpoint.sharded`). Either loads under any strategy and number of processes. Returns the
        path written, in the main process.
        """
        return save_state(self.strategy, state, path)

    def load(self, path: str | Path, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """Read a training state written by :meth:`save` (a file or a sharded checkpoint) onto :attr:`device`.

        ``into`` maps keys of the state to prepared models and optimizers, which are loaded from it in place
        (under a sharded strategy an optimizer reads only the slices of its own shard) and left out of the
        returned dict; every other value is returned whole.

        Raises:
            CheckpointError: the checkpoint is missing, damaged, or has no entry for a key of ``into``.
        """
        return load_state(self.strategy, path, into)

    def close(self, clean: bool = True) -> None:
        """Release the strategy's resources (threads, process groups).

        ``clean=False`` (leaving on an error) skips waiting for the other processes.
        """
        for handle in (*self._handles, *self._first_forward):
            handle.remove()
        self._handles.clear()
        self._first_forward.clear()
        self.strategy.teardown(clean)

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(clean=exc_type is None)
