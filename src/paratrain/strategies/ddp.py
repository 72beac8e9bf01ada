"""One process per device under torchrun (``paratrain launch``), gradients averaged by our DDP.

Each process trains on its slice of every global batch; the loss is weighted by the slice's share of the
global batch, so the averaged gradient equals the single-device gradient on the whole batch even when the
slices are unequal. On GPUs each process takes ``cuda:LOCAL_RANK`` and nccl; on CPU, gloo.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import DEFAULT_TIMEOUT_S, wedged
from ..distributed import DistributedDataParallel
from ..errors import ConfigError
from ..launch import restart_count
from ..scatter_gather import shard
from .base import ReduceOp, Strategy

__all__ = ["DDP_DEVICES", "DistributedStrategy", "launched_by_torchrun"]

DDP_DEVICES = ("auto", "cpu", "cuda")  # each process uses one device: its local rank's GPU, or the CPU

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def launched_by_torchrun() -> bool:
    """True in a worker process started by torchrun (the ecosystem's variables are set)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's variables; after a restart, under a prefix of its own.

    The launcher's store outlives the workers, and the dead workers' keys (gloo's addresses) are still in it: a
    restarted worker reading them fails to connect or waits forever. Keys under a prefix per attempt are fresh.
    """
    restart = restart_count()
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(address, port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    store = dist.PrefixStore(f"paratrain/attempt-{restart}", client)  # type: ignore[attr-defined]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class DistributedStrategy(Strategy):
    """Data parallel across processes: this process is one rank of ``WORLD_SIZE``."""

    name = "ddp"

    def __init__(self, device_type: str = "auto", *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if device_type not in DDP_DEVICES:
            raise ConfigError(f"ddp runs on 'cpu' or 'cuda' (one GPU per process); found {device_type!r}")
        self._device_type = device_type
        self._timeout = timeout
        self._device = torch.device("cpu")
        self._owns_group = False
        self._wrapped: list[DistributedDataParallel] = []

    def setup(self) -> None:
        if not dist.is_initialized():
            if not launched_by_torchrun():
                raise ConfigError(
                    "strategy 'ddp' runs one process per device, started by a launcher: "
                    "`paratrain launch --nproc-per-node N script.py` (or torchrun), or "
                    "`paratrain train --strategy ddp --nproc-per-node N`"
                )
            local_rank = int(os.environ["LOCAL_RANK"])
            use_cuda = self._device_type == "cuda" or (self._device_type == "auto" and torch.cuda.is_available())
            if use_cuda:
                if local_rank >= torch.cuda.device_count():
                    raise ConfigError(
                        f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; start at most "
                        f"that many processes per node, or pass --devices cpu"
                    )
                self._device = torch.device("cuda", local_rank)
                torch.cuda.set_device(self._device)
            backend = "nccl" if use_cuda else "gloo"
            _init_process_group(backend, timedelta(seconds=max(self._timeout, 60.0)))
            self._owns_group = True
        elif dist.get_backend() == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())

    def teardown(self, clean: bool = True) -> None:
        for wrapped in self._wrapped:
            wrapped.close()
        self._wrapped.clear()
        # a group holding a collective that will never complete cannot be destroyed: gloo would wait its own
        # timeout for it; the process is about to end anyway
        if self._owns_group and dist.is_initialized() and wedged() is None:
            if clean:
                # rank 0 hosts the store: nobody leaves while another rank may still talk to it
                dist.barrier()
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
        return f"ddp, {self.world_size} processes, on {self._device.type}"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self._device)
        device_ids = [self._device] if self._device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, timeout=self._timeout)
        self._wrapped.append(wrapped)
        return wrapped

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        return shard(indices, self.rank, self.world_size)

    def loss_weight(self, local_samples: int, global_samples: int) -> float:
        # DDP divides the summed gradients by world_size; each rank's mean loss must count as its share
        return local_samples * self.world_size / global_samples

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        out = tensor.to(self._device, copy=True)  # nccl takes no CPU tensors
        dist.all_reduce(out, op=_OPS["sum" if op == "mean" else op])
        out = out / self.world_size if op == "mean" else out
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # slices may differ in length along dim 0: exchange lengths, pad to the longest, trim after. The
        # collectives run on this process's device (nccl takes no CPU tensors); parts come back where
        # ``tensor`` was.
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        length = torch.tensor([flat.shape[0]], device=self._device)
        lengths = [torch.zeros_like(length) for _ in range(self.world_size)]
        dist.all_gather(lengths, length)
        counts = [int(n) for n in lengths]
        padded = torch.zeros(max(counts), *flat.shape[1:], dtype=flat.dtype, device=self._device)
        padded[: flat.shape[0]] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return [part[:n].to(tensor.device) for part, n in zip(parts, counts, strict=True)]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        out = tensor.to(self._device, copy=True)  # nccl takes no CPU tensors
        dist.broadcast(out, src=src)
        return out.to(tensor.device)

    def barrier(self) -> None:
        dist.barrier()

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield
