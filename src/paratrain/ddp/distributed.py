"""DistributedDataParallel: one process per device, gradients averaged across processes as backward runs.

    torchrun --nproc-per-node 2 train.py          # or: paratrain launch --nproc-per-node 2 train.py
    # in train.py:
    dist.init_process_group("gloo")                # "nccl" on GPUs
    model = paratrain.DistributedDataParallel(model)
    loss_fn(model(x), y).backward()                # gradients are the mean over ranks when backward returns

Start-up checks that every rank holds the same parameters and copies rank 0's values everywhere. Each
backward averages gradients in buckets that overlap with the rest of backward (see ``reducer.py``);
``no_sync()`` skips that for gradient accumulation, ``join()`` lets ranks with less data finish early
(``join.py``), and every collective times out with the names of the ranks that did not arrive. The constructor
takes torch's arguments in torch's order (``ddp_setup.py``); ``docs/ddp.md`` lists each, with what ours does.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import DEFAULT_TIMEOUT_S, CollectiveMonitor
from paratrain.comm.ops import serving_backend
from paratrain.comm.process_groups import group_sequence, to_seconds
from paratrain.ddp.bucket_collective import AllReduce, CollectiveFactory
from paratrain.ddp.comm_hooks import CommHook
from paratrain.ddp.compiled_backward import cut_at_buckets, restore, tell_if_not_cut
from paratrain.ddp.join import Join
from paratrain.ddp.reducer import Reducer
from paratrain.ddp.setup import (
    agree_at_start_up,
    buffer_settings,
    check_device,
    choose_group,
    group_name,
    refuse_unsupported,
    require_trainable,
    warn_check_reduction,
)
from paratrain.devices import DeviceLike
from paratrain.errors import ConfigError, DistributedError
from paratrain.tree import map_tensors
from paratrain.user_keys import UserKeys

__all__ = ["DistributedDataParallel", "Join"]


def _on_grad(reducer_ref: weakref.ref[Reducer], index: int, param: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad(index)


class DistributedDataParallel(UserKeys, nn.Module):
    """Average gradients across processes; a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    Args:
        module: the model, already on this process's device, with a parameter that requires a gradient.
        device_ids: ``None`` (CPU, or a module that manages its own devices) or ``[device]``, the one device of
            this process; inputs are moved there in forward.
        output_device: kept as ``self.output_device`` (default ``device_ids[0]``); outputs stay where the module
            puts them, as in torch. Only with ``device_ids``.
        dim: kept as ``self.dim``; with one device per process nothing is split, as in torch.
        broadcast_buffers: copy rank 0's buffers to every rank at start-up and at the start of each forward
            (``None``: yes); ``False`` leaves both out, as in torch.
        init_sync: check at start-up that every rank holds the same parameters, and copy rank 0's values
            everywhere; ``False`` skips both (the ranks must then start equal by themselves).
        process_group: the group to average over (default: the whole world); every rank of it must wrap.
        bucket_cap_mb: the largest gradient bucket, in MiB (``None``: 25; the first bucket is about 1 MiB).
        find_unused_parameters: parameters that get no gradient in a step take part with zeros; a parameter
            used in any forward since the last synchronisation counts as used, and those unused on every rank
            keep their ``grad`` (``None`` after ``zero_grad``). Without it, such a parameter is an error.
        check_reduction: deprecated by torch; ignored, with torch's ``FutureWarning``.
        gradient_as_bucket_view: make ``.grad`` views into the buckets, saving one copy of the gradients.
        static_graph: the same parameters take part in every iteration, each as often: the first synchronised
            backward learns which (reducing at its end); later ones trust that, so unused parameters,
            parameters used outside forward and reentrant checkpointing work without a graph search.
        skip_all_reduce_unused_params, batched_grad_copy: accepted; torch's speed options, which do not change
            the results (ours reduces whole buckets and copies each gradient once).
        forward_sync_buffers: the per-forward buffer broadcast alone (``None``: as ``broadcast_buffers``); the
            start-up copy of buffers then always runs, as in torch.
        device_mesh: a one-dimensional mesh, whose group is averaged over (instead of ``process_group``).
        timeout: seconds (or a timedelta) any collective may take before the error naming missing ranks.
        hang_report: where the report of every rank goes (JSON) when a collective times out or ranks call
            different collectives (default: ``paratrain-hang-report.json`` in the current directory).

    ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, ``mixed_precision`` (torch's private
    ``_MixedPrecision``) and ``bucket_cap_mb_list`` are refused with a :class:`ConfigError` naming them.

    Raises:
        DistributedError: torch.distributed is not initialised, the ranks' parameters differ, or no parameter
            of the module requires a gradient.
        ConfigError: an argument this class does not support, or a bad value.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
        hang_report: str | None = None,
        _overlap: bool = True,
        _hang_checks: bool = True,
        _collective: CollectiveFactory | None = None,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "DistributedDataParallel needs torch.distributed: call torch.distributed.init_process_group() "
                "first, in every process (started by `paratrain launch` or torchrun), or use paratrain.Parallel"
            )
        refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            bucket_cap_mb_list=bucket_cap_mb_list,
        )
        warn_check_reduction(check_reduction)
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        if not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be positive; found {bucket_cap_mb}")
        # torch's way of keeping some parameters and buffers out of DDP, set on the module (see
        # _set_params_and_buffers_to_ignore_for_model): never averaged nor broadcast
        self.parameters_to_ignore = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        require_trainable(module, self.parameters_to_ignore)
        self.module = module
        self.process_group = choose_group(process_group, device_mesh)
        self._input_device = check_device(module, device_ids)
        if output_device is not None and self._input_device is None:
            raise ConfigError(
                f"output_device goes with device_ids (a module on one device); found output_device="
                f"{output_device!r} and no device_ids: leave output_device out, the module decides"
            )
        self.device_ids = None if self._input_device is None else [self._input_device]
        self.output_device = output_device if output_device is not None else self._input_device
        self.dim = dim
        self.device = next(module.parameters()).device
        self.forward_sync_buffers, init_buffers = buffer_settings(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self._join: Join | None = None
        self._timeout = to_seconds(timeout)
        self._hang_report = hang_report
        self._bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._overlap = _overlap  # private: False waits for the end of backward, so benchmarks can price overlap
        self._hang_checks = _hang_checks  # private: False leaves out the drift check, so benchmarks can price it
        # private: what sums the buckets (the sharded wrappers' reduce-scatter); None: the all-reduce
        self._collective = _collective

        self._attach(self._start_up(self._timeout) if init_sync else self._local_namespace("unsynced"))
        if init_sync:
            states = self._synced(parameters=True, buffers=init_buffers)
            self._broadcast(states, "start-up broadcast of rank 0's state")

    def _attach(self, namespace: str) -> None:
        """What holds the process group and autograd hooks: built at construction and again after unpickling."""
        self.monitor = CollectiveMonitor(
            self.process_group,
            self._timeout,
            namespace=namespace,
            report_path=self._hang_report,
            checks=self._hang_checks,
            device=self.device,
        )
        # stops the monitor's thread when the wrapper is collected, and at interpreter exit (weakref.finalize runs
        # from atexit, before finalization) for a wrapper still alive then and never closed
        self._finalizer = weakref.finalize(self, self.monitor.close)
        named = [
            (name, p)
            for name, p in self.module.named_parameters()
            if p.requires_grad and name not in self.parameters_to_ignore
        ]
        collective = getattr(self, "_collective", None)  # a wrapper pickled before it had one
        if collective is None:
            collective = functools.partial(AllReduce, grad_as_view=self.gradient_as_bucket_view)
        self.reducer = Reducer(
            [p for _, p in named],
            [name for name, _ in named],
            group=self.process_group,
            monitor=self.monitor,
            bucket_cap_bytes=self._bucket_cap_bytes,
            find_unused=self.find_unused_parameters,
            collective=collective,
            static_graph=self.static_graph,
            overlap=self._overlap,
        )
        ref = weakref.ref(self.reducer)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(lambda param, i=i: _on_grad(ref, i, param))
            for i, (_, p) in enumerate(named)
        ]

    @property
    def broadcast_buffers(self) -> bool:
        """Whether each forward copies rank 0's buffers everywhere (torch's older name of forward_sync_buffers)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # -- start-up ---------------------------------------------------------------------------------------------

    def _control_device(self) -> torch.device:
        nccl = serving_backend(self.process_group, self.device) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _start_up(self, timeout: float | None) -> str:
        """Check that every rank holds the same parameters, and agree on the monitor's namespace (ddp_setup.py)."""
        signature = [
            (name, tuple(p.shape), str(p.dtype))
            for name, p in self.module.named_parameters()
            if name not in self.parameters_to_ignore
        ]
        return agree_at_start_up(self.process_group, signature, timeout, self._control_device())

    def _synced(self, *, parameters: bool, buffers: bool) -> list[torch.Tensor]:
        """The parameters and/or buffers DDP keeps equal across ranks: all but those the module asks to ignore."""
        named: list[tuple[str, torch.Tensor]] = []
        if parameters:
            named += list(self.module.named_parameters())
        if buffers:
            named += list(self.module.named_buffers())
        return [t for name, t in named if name not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch's (private) way to keep parameters and buffers, by fully qualified name, out of DDP: call it on
        the module before wrapping it. Those parameters are neither averaged nor broadcast."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]

    def _local_namespace(self, tag: str) -> str:
        """A monitor namespace agreed without communicating: the group's collective count, equal on every rank
        at the same point of a correct program (``init_sync=False``, unpickling)."""
        return f"ddp-{group_name(self.process_group)}-{tag}-{group_sequence(self.process_group)}"

    def _broadcast(self, tensors: Sequence[torch.Tensor], what: str, src: int = 0) -> None:
        """Copy group rank ``src``'s values of ``tensors`` to every rank, one flat message per dtype and device."""
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        source = dist.get_global_rank(self.process_group, src)  # type: ignore[arg-type]
        with torch.no_grad():
            for members in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in members])
                seq = self.monitor.launched()
                work = dist.broadcast(flat, src=source, group=self.process_group, async_op=True)
                self.monitor.wait(work, seq, what)
                for t, piece in zip(members, flat.split([t.numel() for t in members]), strict=True):
                    t.copy_(piece.view_as(t))

    # -- pickling (torch.save(ddp_model), copy.deepcopy): as torch's, over the default group only ---------------

    _NOT_PICKLED = ("process_group", "monitor", "reducer", "_finalizer", "_hook_handles", "_join")

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not dist.group.WORLD:
            raise DistributedError(
                "a DistributedDataParallel over a process_group other than the default one cannot be pickled (as "
                "torch's): save model.module or model.state_dict(), and wrap again after loading"
            )
        state = self.__dict__.copy()
        for name in self._NOT_PICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the reducer and hooks over the default group; no collective runs (every rank loads alike).

        A registered communication hook is not kept (torch's is not either): register it again.
        """
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        self._join = None
        self._attach(self._local_namespace("loaded"))

    # -- the step ---------------------------------------------------------------------------------------------

    # dynamo skips this frame (torch's rule for its DDP's forward): the bookkeeping around the user's module runs
    # eagerly, outside the user's graph, and the module's own forward is what a compiled wrapper traces
    @torch.compiler.disable(recursive=False)  # type: ignore[untyped-decorator]
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs, sync = self._before_forward(inputs, kwargs)
        previous = cut_at_buckets(self._bucket_cap_bytes)  # a compiled backward in pieces (compiled_backward.py)
        try:
            outputs = self.module(*inputs, **kwargs)
        finally:
            restore(previous)
        self._after_forward(outputs, sync)
        return outputs

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool]:
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        authority = self._join.announce(sync) if self._join is not None else 0
        if self.forward_sync_buffers and self.require_forward_param_sync:  # will_sync_module_buffers()
            self._broadcast(self._synced(parameters=False, buffers=True), "buffer broadcast", src=authority)
        if grad:  # a forward without autograd (evaluation mid-step) leaves the pending backward's state alone
            self.reducer.prepare(sync)
            if not self.__dict__.get("_compile_told", False):  # the first training forward
                self._compile_told = True
                tell_if_not_cut(self.module)
        if self._input_device is not None:
            device = self._input_device
            inputs, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (inputs, kwargs))
        return inputs, kwargs, sync

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _after_forward(self, outputs: Any, sync: bool) -> None:
        if sync:
            self.reducer.watch_outputs(outputs)
            if self.find_unused_parameters:
                self.reducer.mark_unreachable(outputs)
        # torch's rule: the next forward broadcasts buffers only if this one was a synchronising training forward
        self.require_forward_param_sync = sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the first backward after it synchronises them all."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for uneven inputs: a rank that runs out of batches shadows the others' collectives.

        Wrap the training loop: ``with model.join(): for x, y in loader: ...``. Gradients are divided by the
        world size (joined ranks contribute zeros), or with ``divide_by_initial_world_size=False`` by the ranks
        still active; at the end every rank takes the model of the last rank to finish. ``enable=False`` does
        nothing; ``throw_on_early_termination=True`` raises on every rank as soon as one runs out. As torch's.
        """
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> Any:
        """Refused: torch's generic ``torch.distributed.algorithms.Join([...])`` needs torch's Joinable protocol."""
        raise ConfigError(
            "paratrain's DistributedDataParallel does not take part in torch.distributed.algorithms.Join (the "
            "generic join over several Joinables): use its own context manager, `with model.join(...):`"
        )

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's rule: only after a synchronising forward)."""
        has_buffers = bool(self._synced(parameters=False, buffers=True))
        return self.require_forward_param_sync and self.forward_sync_buffers and has_buffers

    def _sync_final_model(self, last_to_finish: bool) -> None:
        """After join: the parameters and buffers of the highest rank among the last to finish, everywhere."""
        mine = torch.tensor([self.rank if last_to_finish else -1], dtype=torch.int64, device=self._control_device())
        seq = self.monitor.launched()
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        self.monitor.wait(work, seq, "join: the last rank to finish")
        self._broadcast(self._synced(parameters=True, buffers=True), "join: the final model", src=int(mine))

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``; once, as torch's.

        The hook gets the bucket's gradients, neither summed nor divided yet, and returns a future whose value is
        the averaged buffer; torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work as well.
        """
        if not callable(hook):
            raise ConfigError(f"hook must be callable as hook(state, bucket); found {type(hook).__name__}")
        collective = self.reducer.collective
        if not isinstance(collective, AllReduce):
            raise ConfigError(
                f"a communication hook replaces the all-reduce of each bucket; this wrapper's buckets are summed by "
                f"a {collective.name}: use DistributedDataParallel for a hook"
            )
        if collective.hook is not None:
            raise ConfigError(
                f"register_comm_hook can be called once per DistributedDataParallel (as torch's); "
                f"{getattr(collective.hook, '__name__', 'a hook')} is registered already"
            )
        collective.register_hook(state, hook)

    def _set_static_graph(self) -> None:
        """torch's private, older spelling of ``static_graph=True``, for code written against it; before training."""
        if self.reducer.synchronised_steps:
            raise DistributedError(
                f"_set_static_graph() should be called before training loop starts (as torch's says); "
                f"{self.reducer.synchronised_steps} synchronised backward(s) ran already: pass static_graph=True "
                f"to the constructor instead"
            )
        self.static_graph = True
        self.reducer.static_graph = self.reducer.track_used = True
        self.reducer._reset()

    def close(self) -> None:
        """Detach from autograd and stop background work; call before destroying the process group."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._finalizer()  # monitor.close(), once

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, world_size={self.world_size}, buckets={len(self.reducer.buckets)}, "
            f"find_unused_parameters={self.find_unused_parameters}, static_graph={self.static_graph}"
        )
