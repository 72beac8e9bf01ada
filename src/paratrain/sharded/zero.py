"""Sharded data parallel (ZeRO stages 1 and 2): DDP's training, with the optimizer state and gradients split.

    torchrun --nproc-per-node 4 train.py            # or: paratrain launch; or Parallel("zero2") in train.py
    model = ZeroDataParallel(model, stage=2)         # after torch.distributed.init_process_group()
    optimizer = shard_optimizer(torch.optim.AdamW(model.parameters()), model)   # what par.prepare() does
    loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

The model is our :class:`~paratrain.ddp.distributed.DistributedDataParallel` (start-up broadcast, buckets overlapped
with backward, ``no_sync``, timeouts naming missing ranks), and then:

- every bucket's parameters become views of one flat buffer per bucket, padded to ``world_size`` equal parts
  (:mod:`paratrain.sharded.partition`): rank ``r`` owns part ``r`` of every bucket, parameters straddling parts freely;
- the optimizer (:mod:`paratrain.sharded.optimizer`) holds the state of this rank's parts only, updates them,
  and all-gathers each bucket's weights back into every rank, bucket by bucket as its update ends;
- stage 1 (``zero1``) all-reduces gradients as DDP does (``gradient_as_bucket_view``: the buckets are the
  gradients); stage 2 (``zero2``) reduce-scatters each bucket during backward instead and keeps this rank's
  part of it only (:mod:`paratrain.sharded.reducer`).

Gradients are divided by the world size before they are summed, as DDP divides them, so the sums, and the
parameters after each step, are DDP's bit for bit wherever the collective adds in the same order (any world
size under zero1, and at two ranks under zero2; docs/sharding.md has the measurements).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from paratrain.comm.collectives import DEFAULT_TIMEOUT_S
from paratrain.comm.ops import GroupOps
from paratrain.comm.process_groups import keep_forever
from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.devices import DeviceLike
from paratrain.errors import ConfigError, DistributedError
from paratrain.sharded.grad_norm import clip_to, tensor_norm
from paratrain.sharded.guard import GradientGuard
from paratrain.sharded.optimizer import OwnedPiece, agree_found_inf
from paratrain.sharded.partition import BucketShards, shard_bucket
from paratrain.sharded.reducer import ReduceScatter

__all__ = ["STAGES", "ZeroDataParallel"]

STAGES = (1, 2)


class ZeroDataParallel(DistributedDataParallel):
    """DDP with the optimizer state (``stage=1``), and the gradients too (``stage=2``), sharded across ranks.

    Args:
        module: the model, on this process's device.
        stage: 1 (optimizer state sharded, gradients all-reduced) or 2 (gradients reduce-scattered as well).
        device_ids, process_group, bucket_cap_mb, find_unused_parameters, static_graph, timeout, hang_report: as
            for :class:`~paratrain.ddp.distributed.DistributedDataParallel` (its reducer finds the unused
            parameters and learns a static graph alike for both stages).

    Raises:
        ConfigError: a stage other than 1 or 2.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        device_ids: Sequence[DeviceLike] | None = None,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        timeout: float | timedelta | None = DEFAULT_TIMEOUT_S,
        hang_report: str | None = None,
    ) -> None:
        if stage not in STAGES:
            raise ConfigError(f"ZeRO stage must be 1 (optimizer state sharded) or 2 (and gradients); found {stage!r}")
        super().__init__(
            module,
            device_ids=device_ids,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=stage == 1,  # zero1: the buckets are the gradients, no second copy
            static_graph=static_graph,
            timeout=timeout,
            hang_report=hang_report,
            _collective=ReduceScatter if stage == 2 else None,  # None: ddp's all-reduce
        )
        self.stage = stage
        reducer = self.reducer
        collective = reducer.collective
        # zero2: this rank's parts of the reduced gradients; zero1: the all-reduced buckets
        self._scatter = collective if isinstance(collective, ReduceScatter) else None
        if self._scatter is not None:
            self.shards: list[BucketShards] = self._scatter.shards
        else:
            numels = [p.numel() for p in reducer.params]
            self.shards = [shard_bucket(b, numels, self.world_size) for b in reducer.buckets]
        self.flat = self._flatten()
        # each bucketed parameter's position in the reducer's list, and where it starts in its bucket
        self._index = {id(p): i for i, p in enumerate(reducer.params)}
        self._start_in_bucket = {
            i: offset for bucket in reducer.buckets for i, offset in zip(bucket.indices, bucket.offsets, strict=True)
        }
        self._bucket_of = {i: b for b, bucket in enumerate(reducer.buckets) for i in bucket.indices}
        self.ops = GroupOps(self.process_group, self.device)
        self._gathers: list[tuple[int, Any, int]] = []  # launched by this step: (bucket, Work, collective number)
        self._synchronised: list[Callable[[], None]] = []
        reducer.on_synchronised = self._after_sync

    def _flatten(self) -> list[torch.Tensor]:
        """Make every bucket's parameters views of one padded flat buffer (the weights rank 0 broadcast)."""
        flat = []
        for bucket, shards in zip(self.reducer.buckets, self.shards, strict=True):
            buffer = torch.zeros(shards.padded, dtype=bucket.dtype, device=bucket.device)
            with torch.no_grad():
                for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                    p = self.reducer.params[i]
                    view = buffer.narrow(0, offset, p.numel()).view_as(p)
                    view.copy_(p)
                    p.data = view  # the same Parameter (optimizers, hooks and names still hold it), new storage
            flat.append(buffer)
        return flat

    # -- what the sharded optimizer works on (sharded_optimizer.ShardSource) --------------------------------------

    @property
    def bucket_count(self) -> int:
        return len(self.shards)

    def owned_pieces(self) -> list[OwnedPiece]:
        """This rank's pieces of every bucket's parameters, in bucket order."""
        pieces = []
        for b, shards in enumerate(self.shards):
            base = self.rank * shards.part
            for piece in shards.pieces[self.rank]:
                value = self.flat[b].narrow(0, base + piece.offset, piece.length)
                pieces.append(OwnedPiece(self.reducer.params[piece.param], b, piece.start, value))
        return pieces

    def trains(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the parameters whose gradients this wrapper reduces (and shards)."""
        return id(param) in self._index

    def piece_grad(self, piece: OwnedPiece) -> torch.Tensor | None:
        """The reduced gradient of ``piece`` (a view), or None when its parameter has none."""
        b, index = piece.bucket, self._index[id(piece.param)]
        at = self._start_in_bucket[index] + piece.start  # the piece's first element in the bucket
        scatter = self._scatter
        if scatter is not None:
            if not scatter.reduced[index]:
                return None
            return scatter.grads[b].narrow(0, at - self.rank * self.shards[b].part, piece.length)
        if piece.param.grad is None:
            return None
        return self.reducer.collective.buffers[b].narrow(0, at, piece.length)

    def launch_gather(self, bucket: int) -> None:
        """Start the all-gather that gives every rank bucket ``bucket``'s updated weights from their owners."""
        shards, buffer = self.shards[bucket], self.flat[bucket]
        seq = self.monitor.launched()
        work = self.ops.all_gather(buffer, buffer.narrow(0, self.rank * shards.part, shards.part))
        self._gathers.append((bucket, work, seq))

    def gathers_launched(self) -> None:
        """The step launched every bucket's all-gather (each as its update ended, overlapping the later buckets'
        updates): wait for them, so that whatever reads the weights once ``step()`` returns (the next forward, an
        EMA, ``load_state_dict``, a submodule's ``state_dict``, the raw model) reads the updated ones. On NCCL the
        wait is the stream's: later kernels run after the all-gathers, the host goes on."""
        gathers, self._gathers = self._gathers, []
        for bucket, work, seq in gathers:
            self.monitor.wait(work, seq, f"all-gather of updated parameters, bucket {bucket}")

    def gathers_failed(self) -> None:
        """The step raised before it waited: the all-gathers it launched are not waited for (the job is ending;
        gloo may still write into the buffers, so each Work is kept to the end of the process)."""
        gathers, self._gathers = self._gathers, []
        for _, work, _ in gathers:
            keep_forever(work)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Clear the gradients: the model's ``.grad`` (zero1: views of the buckets) and this rank's parts."""
        for p in self.reducer.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None and not GradientGuard.armed(p):  # zero2's parts are zeroed below
                with torch.no_grad():
                    p.grad.zero_()
        if self._scatter is not None:
            self._scatter.zero_grad(set_to_none)

    def agree_found_inf(self, found: dict[torch.device, torch.Tensor]) -> None:
        """The gradient scaler's per-device inf/nan flags, made the maximum over every rank (in place)."""
        device = self.flat[0].device if self.flat else torch.device("cpu")
        agree_found_inf(found, device, self._control_device(), self.process_group, self.monitor)

    def grads_unscaled(self, params: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> None:
        """The gradient scaler multiplied this rank's pieces of ``params``' gradients by ``inv_scale``: the rest of
        what this rank holds of them gets the same. zero1: the other ranks' parts of the whole gradients (which a
        clip's norm reads, as torch's function on ddp's unscaled ``.grad``); zero2: the whole-gradient norms measured
        during backward (each scaled by the factor: the same float, the factor being a power of 2)."""
        indices = [i for p in params if (i := self._index.get(id(p))) is not None]
        if self._scatter is not None:
            self._scatter.norms_unscaled(indices, inv_scale)
            return
        others: list[torch.Tensor] = []
        for i in indices:
            if self.reducer.params[i].grad is None:
                continue
            b = self._bucket_of[i]
            start, end = self._start_in_bucket[i], self._start_in_bucket[i] + self.reducer.params[i].numel()
            own_start, own_end = self.rank * self.shards[b].part, (self.rank + 1) * self.shards[b].part
            buffer = self.reducer.collective.buffers[b]
            for lo, hi in ((start, min(end, own_start)), (max(start, own_end), end)):
                if hi > lo:
                    others.append(buffer.narrow(0, lo, hi - lo))
        if others:
            torch._foreach_mul_(others, inv_scale.to(others[0].device))

    def on_synchronised(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` at the end of every backward that reduced gradients (optimizers assign theirs)."""
        self._synchronised.append(callback)

    def _after_sync(self) -> None:
        for callback in self._synchronised:
            callback()

    # -- global views ----------------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` on the module's parameters under DDP: the same norm, the same clipped gradients.

        zero1 holds the whole gradients on every rank: torch's function itself. zero2 takes each parameter's
        whole-gradient norm (measured while its bucket was whole, :meth:`ReduceScatter.whole_norms`), torch's total
        of them, and scales this rank's pieces by torch's coefficient. A collective under zero2: every rank calls it.
        """
        scatter = self._scatter
        if scatter is None:
            with_grads = [p for p in self.module.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(with_grads, max_norm, norm_type)
        whole = scatter.whole_norms(float(norm_type))
        norms: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for p in self.module.parameters():  # torch's order: the norms are stacked in it
            index = self._index.get(id(p))
            if index is not None:
                if index in whole:
                    norms.append(whole[index])
            elif p.grad is not None:  # not reduced (ignored by DDP): its local gradient, as under DDP
                norms.append(tensor_norm(p.grad, float(norm_type)))
                grads.append(p.grad)
        grads += [g for piece in self.owned_pieces() if (g := self.piece_grad(piece)) is not None]
        return clip_to(norms, grads, max_norm, float(norm_type))

    def full_gradients(self) -> list[torch.Tensor | None]:
        """Every bucketed parameter's whole reduced gradient (a collective: every rank calls it), in reducer order.

        For checks (paratrain verify): gathers this rank's parts of every bucket from every rank.
        """
        grads: list[torch.Tensor | None] = [None] * len(self.reducer.params)
        for b, shards in enumerate(self.shards):
            bucket = self.reducer.buckets[b]
            part = torch.zeros(shards.part, dtype=bucket.dtype, device=bucket.device)
            for piece in self.owned_pieces():
                if piece.bucket == b and (g := self.piece_grad(piece)) is not None:
                    at = self._start_in_bucket[self._index[id(piece.param)]] + piece.start - self.rank * shards.part
                    part.narrow(0, at, piece.length).copy_(g)
            whole = torch.empty(shards.padded, dtype=bucket.dtype, device=bucket.device)
            seq = self.monitor.launched()
            self.monitor.wait(self.ops.all_gather(whole, part), seq, f"gradients of bucket {b}")
            for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                p = self.reducer.params[i]
                if self._has_grad(i):
                    grads[i] = whole.narrow(0, offset, p.numel()).view_as(p).clone()
        return grads

    def _has_grad(self, index: int) -> bool:
        if self._scatter is not None:
            return self._scatter.reduced[index]
        return self.reducer.params[index].grad is not None

    # -- what DDP offers and the sharded wrapper does not -----------------------------------------------------

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"join() is not supported under zero{self.stage}: give every rank the same number of batches (a "
            f"prepared loader does), or use strategy ddp for uneven inputs"
        )

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """zero1: as DDP's (the hook replaces the all-reduce of each gradient bucket; the weights' all-gathers
        stay). zero2 refuses: its gradients are reduce-scattered, and a hook stands in for an all-reduce."""
        if self.stage == 1:
            super().register_comm_hook(state, hook)
            return
        raise ConfigError(
            f"communication hooks are not supported under zero{self.stage}: its gradients are reduce-scattered, "
            f"and a hook replaces an all-reduce; use strategy ddp or zero1 for a hook"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise DistributedError(
            "a ZeroDataParallel cannot be pickled: save its state through Parallel.save (a sharded checkpoint), "
            "or model.module.state_dict()"
        )

    def extra_repr(self) -> str:
        return f"stage={self.stage}, {super().extra_repr()}"
