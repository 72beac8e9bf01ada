"""DistributedDataParallel: one process per device, gradients averaged across processes as backward runs.

    torchrun --nproc-per-node 2 train.py          # or: paratrain launch --nproc-per-node 2 train.py
    # in train.py:
    dist.init_process_group("gloo")                # "nccl" on GPUs
    model = paratrain.DistributedDataParallel(model)
    loss_fn(model(x), y).backward()                # gradients are the mean over ranks when backward returns

Start-up checks that every rank holds the same parameters and copies rank 0's values everywhere. Each
backward averages gradients in buckets that overlap with the rest of backward (see ``reducer.py``);
``no_sync()`` skips that for gradient accumulation, ``join()`` lets ranks with less data finish early, and
every collective times out with the names of the ranks that did not arrive.
"""

from __future__ import annotations

import hashlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import DEFAULT_TIMEOUT_S, CollectiveMonitor, group_sequence, to_seconds, wait_work
from .comm_hooks import CommHook
from .devices import DeviceLike, parse_device
from .errors import ConfigError, DeviceError, DistributedError
from .reducer import Reducer
from .tree import map_tensors

__all__ = ["DistributedDataParallel", "Join"]


def _on_grad(reducer_ref: weakref.ref[Reducer], index: int, param: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad(index)


class DistributedDataParallel(nn.Module):
    """Average gradients across processes; a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    Args:
        module: the model, already on this process's device.
        device_ids: ``None`` (CPU, or a module that manages its own devices) or ``[device]``, the one device of
            this process; inputs are moved there in forward.
        process_group: the group to average over (default: the whole world).
        bucket_cap_mb: the largest gradient bucket, in MiB (the first bucket is about 1 MiB).
        broadcast_buffers: copy rank 0's buffers to every rank at the start of each forward.
        find_unused_parameters: parameters that get no gradient in a step take part with zeros; those unused
            on every rank keep ``grad=None``. Without it, such a parameter is an error at the end of backward.
        gradient_as_bucket_view: make ``.grad`` views into the buckets, saving one copy of the gradients.
        timeout: seconds (or a timedelta) any collective may take before the error naming missing ranks.

    Raises:
        DistributedError: torch.distributed is not initialised, or the ranks' parameters differ.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        process_group: Any = None,
        bucket_cap_mb: float = 25,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        *,
        timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
        _overlap: bool = True,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "DistributedDataParallel needs torch.distributed: call torch.distributed.init_process_group() "
                "first, in every process (started by `paratrain launch` or torchrun), or use paratrain.Parallel"
            )
        if not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be positive; found {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.device = self._check_device(module, device_ids)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self._join: Join | None = None

        namespace = self._start_up(to_seconds(timeout))
        self.monitor = CollectiveMonitor(self.process_group, timeout, namespace=namespace)
        # stops the monitor's thread when the wrapper is collected, and at interpreter exit (weakref.finalize runs
        # from atexit, before finalization) for a wrapper still alive then and never closed
        self._finalizer = weakref.finalize(self, self.monitor.close)
        self._broadcast(list(module.parameters()) + list(module.buffers()), "start-up broadcast of rank 0's state")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.reducer = Reducer(
            [p for _, p in named],
            [name for name, _ in named],
            group=self.process_group,
            monitor=self.monitor,
            bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024),
            find_unused=find_unused_parameters,
            grad_as_view=gradient_as_bucket_view,
            overlap=_overlap,  # private: False waits for the end of backward, so benchmarks can price the overlap
        )
        ref = weakref.ref(self.reducer)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(lambda param, i=i: _on_grad(ref, i, param))
            for i, (_, p) in enumerate(named)
        ]

    # -- start-up ---------------------------------------------------------------------------------------------

    @staticmethod
    def _check_device(module: nn.Module, device_ids: Sequence[DeviceLike] | None) -> torch.device | None:
        if device_ids is None:
            return None
        if isinstance(device_ids, (str, int, torch.device)) or len(device_ids) != 1:
            raise ConfigError(
                f"device_ids must be None or a list with this process's one device, e.g. [local_rank]; "
                f"found {device_ids!r}"
            )
        device = parse_device(device_ids[0], what="device_ids[0]")
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            if t.device != device:
                raise DeviceError(
                    f"DistributedDataParallel expects the module on {device} (device_ids[0]), but {name!r} is "
                    f"on {t.device}; call module.to({str(device)!r}) before wrapping it"
                )
        return device

    def _control_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self._backend() == "nccl" else torch.device("cpu")

    def _backend(self) -> str:
        return str(dist.get_backend(self.process_group))

    def _start_up(self, timeout: float | None) -> str:
        """Check that every rank holds the same parameters (names, shapes, dtypes), and agree on a namespace.

        One all-gather carries a digest of the parameters and how many collectives the group has run (torch
        counts them per group). The namespace of this wrapper's collective monitor is the largest count: the
        same on every rank, and larger than that of any earlier wrapper over the group, so its store keys can
        neither drift apart across ranks nor collide with another wrapper's.
        """
        signature = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.module.named_parameters()]
        digest = int.from_bytes(hashlib.sha256(repr(signature).encode()).digest()[:7], "big")
        sequence = group_sequence(self.process_group)
        mine = torch.tensor([digest, sequence], dtype=torch.int64, device=self._control_device())
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(everyone, mine, group=self.process_group, async_op=True)
        if not wait_work(work, timeout):
            raise DistributedError(
                f"rank {dist.get_rank()}: the start-up check of DistributedDataParallel did not complete within "
                f"{timeout:g}s: some rank of the group has not constructed its wrapper (or is stuck). Wrap the "
                f"model in every process, at the same point of the script"
            )
        agreed = max(int(t[1]) for t in everyone)
        if any(int(t[0]) != digest for t in everyone):
            signatures: list[Any] = [None] * self.world_size
            dist.all_gather_object(signatures, signature, group=self.process_group)
            raise DistributedError(_describe_mismatch(signatures))
        return f"ddp-{_group_name(self.process_group)}-{agreed}"

    def _broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Copy rank 0's values of ``tensors`` to every rank, one flat message per dtype and device."""
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for members in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in members])
                seq = self.monitor.launched()
                src = dist.get_global_rank(self.process_group, 0)  # type: ignore[arg-type]  # the group's rank 0
                work = dist.broadcast(flat, src=src, group=self.process_group, async_op=True)
                self.monitor.wait(work, seq, what)
                for t, piece in zip(members, flat.split([t.numel() for t in members]), strict=True):
                    t.copy_(piece.view_as(t))

    # -- the step ---------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if self._join is not None:
            self._join.announce(sync)
        if self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()), "buffer broadcast")
        if grad:  # a forward without autograd (evaluation mid-step) leaves the pending backward's state alone
            self.reducer.prepare(sync)
        if self.device is not None:
            device = self.device
            inputs, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (inputs, kwargs))
        outputs = self.module(*inputs, **kwargs)
        if sync and self.find_unused_parameters:
            self.reducer.mark_unreachable(outputs)
        return outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the first backward after it synchronises them all."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def join(self) -> Join:
        """Context manager for uneven inputs: a rank that runs out of batches shadows the others' collectives.

        Wrap the training loop: ``with model.join(): for x, y in loader: ...``. Gradients are still divided
        by the full world size (joined ranks contribute zeros), as torch's DDP does by default.
        """
        return Join(self)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket) -> Future[Tensor]``."""
        if not callable(hook):
            raise ConfigError(f"hook must be callable as hook(state, bucket); found {type(hook).__name__}")
        self.reducer.hook = hook
        self.reducer.hook_state = state

    def close(self) -> None:
        """Detach from autograd and stop background work; call before destroying the process group."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._finalizer()  # monitor.close(), once

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, world_size={self.world_size}, buckets={len(self.reducer.buckets)}, "
            f"find_unused_parameters={self.find_unused_parameters}"
        )


class Join:
    """The context manager returned by :meth:`DistributedDataParallel.join`."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def __enter__(self) -> Join:
        self.ddp._join = self
        return self

    def _flags(self, active: int, sync: int) -> tuple[int, int]:
        ddp = self.ddp
        flags = torch.tensor([active, sync], dtype=torch.int64, device=ddp._control_device())
        seq = ddp.monitor.launched()
        work = dist.all_reduce(flags, group=ddp.process_group, async_op=True)
        ddp.monitor.wait(work, seq, "join: active-rank count")
        return int(flags[0]), int(flags[1])

    def announce(self, sync: bool) -> None:
        """An active rank's forward: count it, and say whether this iteration synchronises gradients."""
        self._flags(1, int(sync))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is not None:
                return  # a failing rank must not pretend to be done; the error propagates
            ddp = self.ddp
            while True:
                active, syncing = self._flags(0, 0)
                if active == 0:
                    return  # everyone is done
                if ddp.broadcast_buffers:
                    ddp._broadcast(list(ddp.module.buffers()), "buffer broadcast (joined rank)")
                if syncing:
                    ddp.reducer.shadow()
        finally:
            self.ddp._join = None


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else "world"


def _describe_mismatch(signatures: list[Any]) -> str:
    reference = signatures[0]
    lines = []
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature == reference:
            continue
        for i in range(max(len(signature), len(reference))):
            mine = signature[i] if i < len(signature) else None
            theirs = reference[i] if i < len(reference) else None
            if mine != theirs:
                lines.append(f"rank 0 has {_fmt(theirs)} but rank {rank} has {_fmt(mine)} (parameter #{i})")
                break
    different = [str(r) for r, s in enumerate(signatures) if s != reference]
    return (
        f"the model's parameters differ across ranks (ranks {', '.join(different)} differ from rank 0): "
        + "; ".join(lines)
        + ". Build the same model, with the same settings, in every process before wrapping it"
    )


def _fmt(entry: Any) -> str:
    if entry is None:
        return "no parameter"
    name, shape, dtype = entry
    return f"{name!r} {tuple(shape)} {dtype.removeprefix('torch.')}"
