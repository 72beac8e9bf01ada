"""One process per device under torchrun (``paratrain launch``), gradients averaged by our DDP.

Each process trains on its slice of every global batch; the loss is weighted by the slice's share of the
global batch, so the averaged gradient equals the single-device gradient on the whole batch even when the
slices are unequal. On GPUs each process takes ``cuda:LOCAL_RANK`` and nccl; on CPU, gloo.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import DEFAULT_TIMEOUT_S, CollectiveMonitor
from paratrain.comm.meeting import Meeting
from paratrain.comm.ops import serving_backend
from paratrain.comm.process_groups import default_store, group_sequence
from paratrain.compiled import without_compiled
from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.ddp.options import DDPOptions, Refusal, refuse_options
from paratrain.diagnostics.flight_recorder import small_buffer_unless_set
from paratrain.diagnostics.stacks import calling
from paratrain.dp.scatter_gather import shard
from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError
from paratrain.strategies.base import ReduceOp, Strategy

__all__ = ["DDP_DEVICES", "DistributedStrategy"]

DDP_DEVICES = ("auto", "cpu", "cuda")  # each process uses one device: its local rank's GPU, or the CPU

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_INITS = [0]  # process groups this process initialised so far


def _init_process_group(env: ClusterEnvironment, backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from the launcher's environment; after a restart, or for a second group in this
    process, under a prefix of its own.

    The launcher's store outlives the workers' groups, and an earlier group's keys (gloo's addresses) are still in
    it: a restarted worker, or a worker whose first ``Parallel`` destroyed its group, reading them connects to a
    listener that is gone, or waits forever (torch numbers its default groups from 0 again after
    ``destroy_process_group``). Keys under a prefix per attempt and per group are fresh.
    """
    count = _INITS[0]
    _INITS[0] += 1
    if env.scheduler != "torchrun":  # srun, a PyTorchJob pod, mpirun: no launcher's store; rank 0 hosts one
        dist.init_process_group(
            backend, init_method=env.init_method, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
        return
    fresh = env.restart_count or count
    if not fresh or not env.agent_store or env.master_addr is None or env.master_port is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    prefix = f"paratrain/attempt-{env.restart_count}" + (f"/group-{count}" if count else "")
    store = dist.PrefixStore(prefix, client)  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


class DistributedStrategy(Strategy):
    """Data parallel across processes: this process is one rank of the launcher's world.

    Args:
        device_type: ``auto`` (this process's GPU when CUDA is available, else the CPU), ``cpu`` or ``cuda``.
        timeout: seconds any collective (the gradients', and the loop's own metrics) may wait for the others.
        environment: where this process sits in the job; default: what the launcher set
            (:meth:`~paratrain.environment.ClusterEnvironment.detect`).
        hang_report: where the report of every rank goes when a collective times out (see docs/hangs.md).
        options: how each model's wrapper is built (:class:`~paratrain.ddp.options.DDPOptions`; default: its
            defaults). ddp honours every option; a sharded strategy refuses, by name, those it cannot honour.

    Raises:
        ConfigError: a device type other than ``auto``, ``cpu`` or ``cuda``, or an option this strategy refuses
            (before any process-group work).
    """

    name = "ddp"
    # the options this strategy cannot honour, and why: refused when it is built (ddp honours them all)
    refused_options: ClassVar[dict[str, Refusal]] = {}

    def __init__(
        self,
        device_type: str = "auto",
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        environment: ClusterEnvironment | None = None,
        hang_report: str | None = None,
        options: DDPOptions | None = None,
    ) -> None:
        super().__init__()
        if device_type not in DDP_DEVICES:
            raise ConfigError(f"ddp runs on 'cpu' or 'cuda' (one GPU per process); found {device_type!r}")
        self.options = options if options is not None else DDPOptions()
        refuse_options(self.name, self.options, self.refused_options)
        self._device_type = device_type
        self._timeout = timeout
        self._hang_report = hang_report
        self.environment = environment if environment is not None else ClusterEnvironment.detect()
        self._device = torch.device("cpu")
        self._owns_group = False
        self._ddp: list[DistributedDataParallel] = []
        self._monitor: CollectiveMonitor | None = None
        self._meeting: Meeting | None = None

    def setup(self) -> None:
        if not dist.is_initialized():
            env = self.environment
            if not env.launched:
                raise ConfigError(
                    f"strategy {self.name!r} runs one process per device, started by a launcher: "
                    f"`paratrain launch --nproc-per-node N script.py` (or torchrun, or a scheduler: srun, a "
                    f"PyTorchJob, mpirun), or `paratrain train --strategy {self.name} --nproc-per-node N`"
                )
            use_cuda = self._device_type == "cuda" or (self._device_type == "auto" and torch.cuda.is_available())
            if use_cuda:
                if env.local_rank >= torch.cuda.device_count():
                    raise ConfigError(
                        f"local rank {env.local_rank} has no GPU: {torch.cuda.device_count()} visible; start at "
                        f"most that many processes per node, or pass --devices cpu"
                    )
                self._device = torch.device("cuda", env.local_rank)
                torch.cuda.set_device(self._device)
            backend = "nccl" if use_cuda else "gloo"
            small_buffer_unless_set()  # torch's Flight Recorder, read when ranks disagree: small is cheap to read
            _init_process_group(env, backend, timedelta(seconds=max(self._timeout, 60.0)))
            self._owns_group = True
        elif torch.cuda.is_available() and serving_backend(dist.group.WORLD, "cuda") == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        group = dist.group.WORLD
        namespace = f"strategy-{group_sequence(group)}"
        self._monitor = CollectiveMonitor(
            group, self._timeout, namespace=namespace, report_path=self._hang_report, device=self._device
        )
        store = default_store()
        if store is not None:
            self._meeting = Meeting(
                store, f"paratrain/{namespace}/meet", dist.get_rank(), self._timeout, self._peers_gone
            )
        # its thread stops when the strategy is collected (a Parallel never closed), or at interpreter exit
        self._finalizer = weakref.finalize(self, self._monitor.close)

    @property
    def meeting(self) -> Meeting | None:
        return self._meeting

    def monitors(self) -> list[CollectiveMonitor]:
        """Every monitor numbering this strategy's collectives: its own, and each wrapper's."""
        return [w.monitor for w in self._ddp] + ([self._monitor] if self._monitor is not None else [])

    def _peers_gone(self) -> dict[int, str]:
        gone: dict[int, str] = {}
        for monitor in self.monitors():
            for rank, how in monitor.peers_gone().items():
                gone.setdefault(rank, how)
        return gone

    @property
    def failure(self) -> str | None:
        """Why a collective of this strategy (or of a model it wrapped) timed out or failed, if one did."""
        return next((m.failure for m in self.monitors() if m.failure is not None), None)

    @property
    def collective_wait_seconds(self) -> float:
        return sum(m.waited for m in self.monitors())

    def teardown(self, clean: bool = True) -> None:
        failure = self.failure
        for wrapped in self._ddp:
            wrapped.close()
        self._ddp.clear()
        # a group holding a collective that will never complete cannot be destroyed: gloo would wait its own
        # timeout for it; the process is about to end anyway
        destroy = self._owns_group and dist.is_initialized() and failure is None
        if destroy and clean:
            self.barrier()  # rank 0 hosts the store: nobody leaves while another rank may still talk to it
        if self._monitor is not None:
            self._finalizer()  # monitor.close(): its thread writes to the store, stopped before the group goes
            self._monitor = None
        if destroy:
            dist.destroy_process_group()
        self._owns_group = False

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def devices(self) -> list[torch.device]:
        return [self._device]

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def world_devices(self) -> list[str]:
        # the names as bytes in a tensor: nothing is unpickled from the other ranks
        mine = torch.tensor(list(str(self._device).encode()), dtype=torch.uint8)
        return [bytes(part.tolist()).decode() for part in self.all_gather(mine)]

    def describe(self) -> str:
        n = self.world_size
        return f"ddp, {n} process{'es' * (n != 1)}, on {self._device.type}"

    def _wrap(self, model: nn.Module) -> nn.Module:
        # by default the buckets are the gradients (torch's gradient_as_bucket_view): one copy of them, not two,
        # as the sharded strategies keep them too (docs/sharding.md's memory table)
        wrapped = DistributedDataParallel(
            model.to(self._device), gradient_as_bucket_view=self.options.gradient_as_bucket_view, **self._wrapper_args()
        )
        return self._adopt(wrapped)

    def _wrapper_args(self) -> dict[str, Any]:
        """What every DDP-based wrapper of this strategy is built with: its device, the options, the timeout."""
        options = self.options  # what a strategy refuses was refused when it was built
        return {
            "device_ids": [self._device] if self._device.type == "cuda" else None,
            "bucket_cap_mb": options.bucket_cap_mb,
            "find_unused_parameters": options.find_unused_parameters,
            "static_graph": options.static_graph,
            "timeout": self._timeout,
            "hang_report": self._hang_report,
        }

    def _adopt(self, wrapped: DistributedDataParallel) -> DistributedDataParallel:
        """Keep ``wrapped`` (closed at teardown) and register the options' communication hook on it."""
        self._ddp.append(wrapped)
        if self.options.comm_hook is not None:
            wrapped.register_comm_hook(self.options.comm_state, self.options.comm_hook)
        return wrapped

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        return shard(indices, self.rank, self.world_size)

    def loss_weight(self, local_samples: int, global_samples: int) -> float:
        # DDP divides the summed gradients by world_size; each rank's mean loss must count as its share
        return local_samples * self.world_size / global_samples

    # -- collectives, each watched by the strategy's monitor: a rank that never arrives is named ---------------

    def _run(self, what: str, launch: Any) -> None:
        monitor = self._monitor
        if monitor is None:
            raise ConfigError("the ddp strategy's collectives need setup() first (Parallel calls it)")
        self._meet(monitor, what)
        seq = monitor.launched()
        monitor.wait(launch(), seq, what)

    def _meet(self, monitor: CollectiveMonitor, what: str) -> None:
        """Before each of the strategy's collectives every rank meets the others in the store and says which one it
        is about to run. A rank that went on without it (it launched a collective of the group this rank has not) or
        that is about to run another is named now, with the user's line and the rule: launched, the collective would
        be paired with whatever the peer runs next, which gloo refuses by aborting the process when the sizes differ
        and sums silently when they match. The strategy's collectives are the loop's own calls (a metric, a barrier, a
        save), not the training step's, so a meeting's store round trips are not paid at every step.

        Raises:
            CollectiveError: a rank went on, or runs another collective, or did not come within the timeout.
        """
        meeting = self._meeting
        if meeting is None or self.world_size < 2:
            return
        call, line = calling()
        call = call or what
        posted = meeting.attend(
            "collective",
            range(self.world_size),
            call,
            lambda gone: _went_on(self.rank, call, line, gone),
            value=f"{what}\t{call}\t{line}",
            error=lambda message: monitor.refusal(message, f"{call} that not every rank called"),
            overdue=lambda missing: monitor.unmet_error(what, missing),
        )
        calls = {rank: value.split("\t") for rank, value in posted.items()}
        if any(theirs[0] != what for theirs in calls.values()):
            calls[self.rank] = [what, call, line]
            raise monitor.refusal(_different_calls(self.rank, calls), "the ranks called different collectives")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        out = tensor.to(self._device, copy=True)  # nccl takes no CPU tensors
        reduce_op = _OPS["sum" if op == "mean" else op]
        self._run(
            f"all_reduce ({op}) of a {_described(out)}",
            lambda: dist.all_reduce(out, op=reduce_op, async_op=True),
        )
        out = out / self.world_size if op == "mean" else out
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # slices may differ in length along dim 0: exchange lengths, pad to the longest, trim after. The
        # collectives run on this process's device (nccl takes no CPU tensors); parts come back where
        # ``tensor`` was.
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        length = torch.tensor([flat.shape[0]], device=self._device)
        lengths = [torch.zeros_like(length) for _ in range(self.world_size)]
        self._run("all_gather of the parts' lengths", lambda: dist.all_gather(lengths, length, async_op=True))
        counts = [int(n) for n in lengths]
        padded = torch.zeros(max(counts), *flat.shape[1:], dtype=flat.dtype, device=self._device)
        padded[: flat.shape[0]] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._run(f"all_gather of a {_described(padded)}", lambda: dist.all_gather(parts, padded, async_op=True))
        return [part[:n].to(tensor.device) for part, n in zip(parts, counts, strict=True)]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = tensor.to(self._device, copy=True)  # nccl takes no CPU tensors
        self._run(
            f"broadcast from rank {src} of a {_described(out)}", lambda: dist.broadcast(out, src=src, async_op=True)
        )
        return out.to(tensor.device)

    def barrier(self) -> None:
        self._run("barrier", lambda: dist.barrier(async_op=True))

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self.check_prepared(model, "no_sync()")
        plain = without_compiled(model)
        wrapper = next((w for w in self._ddp if plain in (w, without_compiled(w.module))), None)
        if wrapper is None:
            yield
            return
        with wrapper.no_sync():
            yield


def _described(tensor: torch.Tensor) -> str:
    """``float32 tensor of 4 elements``: what a collective carries, for the errors that name it."""
    return f"{str(tensor.dtype).removeprefix('torch.')} tensor of {tensor.numel()} element{'s' * (tensor.numel() != 1)}"


def _at(line: str) -> str:
    return f" at {line}" if line else ""


def _went_on(rank: int, call: str, line: str, gone: dict[int, str]) -> str:
    """The refusal of a strategy collective a peer went on without (``par.barrier()`` under ``if par.is_main:``)."""
    others = "; ".join(f"rank {peer} went on without it: it {how}" for peer, how in sorted(gone.items()))
    return (
        f"rank {rank}: {call}{_at(line)} is a collective, called on rank {rank} but not on every rank: {others}. "
        f"Every rank calls {call} at the same point, not under a condition on the rank (`if par.is_main:`): call it "
        f"on every rank, and use its result on one"
    )


def _different_calls(rank: int, calls: dict[int, list[str]]) -> str:
    """The refusal of ranks about to run different collectives of the strategy (rank 0 an all-reduce, rank 1 a
    barrier; or all-reduces of different sizes)."""
    each = ", ".join(f"rank {r} in {call}{_at(line)} ({what})" for r, (what, call, line) in sorted(calls.items()))
    return (
        f"rank {rank}: the ranks are in different paratrain collectives: {each}. Every rank makes the same paratrain "
        f"calls (par.all_reduce, broadcast, gather, barrier, save) in the same order, with tensors of the same size, "
        f"not under a condition on the rank"
    )
