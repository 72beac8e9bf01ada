"""DataParallel: one process, several devices; scatter -> replicate -> parallel_apply -> gather.

model = paratrain.DataParallel(SimpleNet(), device_ids=[0, 1])        # two GPUs
model = paratrain.DataParallel(SimpleNet(), device_ids=["cpu"] * 3)   # three CPU replicas (tests)
out = model(x)            # x: (30, 784) -> three replicas of 10 each -> out: (30, 10) on device_ids[0]
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from paratrain.devices import DeviceLike, parse_device, parse_device_list
from paratrain.diagnostics.profiling import phase
from paratrain.dp.parallel_apply import ThreadState, WorkerPool, parallel_apply
from paratrain.dp.replicate import BUFFER_MODES, BufferMode, ReplicaSet, Replicator
from paratrain.dp.scatter_gather import Scattered, gather, scatter
from paratrain.errors import ConfigError, DeviceError
from paratrain.user_keys import UserKeys

__all__ = ["DataParallel"]


class DataParallel(UserKeys, nn.Module):
    """Run ``module`` on several devices at once by splitting each batch along ``dim``.

    A drop-in for ``torch.nn.DataParallel`` with the same arguments and contract, built from this package's
    own scatter, replicate, parallel_apply and gather. Differences, all on purpose:

    - the split is balanced: 6 samples on 4 devices give [2, 2, 1, 1], not [2, 2, 2] with a device idle;
      ``chunk_sizes`` sets it explicitly;
    - keyword arguments are split by the same rule as positional ones and never dropped;
    - devices may repeat, and ``"cpu"`` entries give CPU replicas (each in its own thread);
    - buffers updated in forward (BatchNorm statistics) get the sample-weighted mean of every replica's
      update (``buffers="mean"``), not just replica 0's (``buffers="first"``, torch's behaviour);
    - replica module objects and worker threads are built once and reused across calls.

    Args:
        module: the model; it must live on ``device_ids[0]`` when called.
        device_ids: ints (GPU indices), strings (``"cuda:1"``, ``"cpu"``) or ``torch.device``; ``None`` means
            every visible GPU, and with no GPU the module simply runs as is.
        output_device: where outputs are gathered (default ``device_ids[0]``; ``-1`` means the CPU).
        dim: the batch dimension inputs are split along and outputs concatenated along.
        chunk_sizes: explicit samples per device (one entry per device, zeros skip a device); they must sum to
            the batch size. ``None`` splits evenly.
        buffers: ``"mean"`` or ``"first"``: how replicas' in-forward buffer updates reach the module.

    Raises:
        DeviceError: for an empty, unknown or mixed device list, an unusable ``output_device``, or (when
            called) a module that is not on ``device_ids[0]``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        chunk_sizes: Sequence[int] | None = None,
        *,
        buffers: BufferMode = "mean",
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"DataParallel wraps an nn.Module; found {type(module).__name__}")
        if buffers not in BUFFER_MODES:
            raise ConfigError(f"buffers must be one of {BUFFER_MODES}; found {buffers!r}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ConfigError(f"dim must be an int; found {dim!r}")
        self.module = module
        self.dim = dim
        self.buffers_mode: BufferMode = buffers
        self.device_ids: list[torch.device] = parse_device_list(device_ids)
        if not self.device_ids:
            # no GPU and no devices asked for: run the module as it is, like torch.nn.DataParallel does
            self.output_device: torch.device | None = None
            self.chunk_sizes = None
            self._setup_runtime()
            return
        self.output_device = (
            self.device_ids[0] if output_device is None else parse_device(output_device, what="output_device")
        )
        self.chunk_sizes = None if chunk_sizes is None else list(chunk_sizes)
        if self.chunk_sizes is not None and len(self.chunk_sizes) != len(self.device_ids):
            raise ConfigError(
                f"chunk_sizes has {len(self.chunk_sizes)} entries but device_ids has {len(self.device_ids)}; "
                f"give one size per device"
            )
        self._setup_runtime()

    # -- runtime state that is rebuilt, never pickled ---------------------------------------------------------

    def _setup_runtime(self) -> None:
        self._replicator = Replicator(self.module, self.device_ids)
        self._pool = WorkerPool()
        self._lock = threading.Lock()
        self._streams: list[torch.cuda.Stream | None] | None = None
        self._finalizer = weakref.finalize(self, self._pool.close)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_replicator", "_pool", "_lock", "_streams", "_finalizer"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._setup_runtime()

    def close(self) -> None:
        """Stop the worker threads now instead of when the object is collected."""
        self._finalizer()

    @property
    def src_device_obj(self) -> torch.device | None:
        """The device the module must live on (torch's name for it)."""
        return self.device_ids[0] if self.device_ids else None

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids) or "module as is"
        return f"devices=[{devices}], output_device={self.output_device}, dim={self.dim}"

    # -- the pipeline -----------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        self.check_module_device()
        with phase("paratrain::DataParallel.scatter"):
            shares = self.scatter(inputs, kwargs)
        if len(self.device_ids) == 1:
            # one device: no replicas, no threads; the module is just called there
            out = self.module(*shares[0].args, **shares[0].kwargs)
            if self.output_device == self.device_ids[0]:
                return out
            with phase("paratrain::DataParallel.gather"):
                return self.gather([out])
        with self._lock:  # the replica objects are shared state: one forward at a time per wrapper
            with phase("paratrain::DataParallel.replicate"):
                replicas = self.replicate(shares)
            try:
                with phase("paratrain::DataParallel.parallel_apply"):
                    outputs = self.parallel_apply(replicas, shares)
                self.sync_buffers(replicas, shares)
            finally:
                replicas.release()
        with phase("paratrain::DataParallel.gather"):
            return self.gather(outputs)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Scattered]:
        """Split the batch: one share per device that gets samples."""
        return scatter(inputs, kwargs, self.device_ids, self.dim, self.chunk_sizes)

    def replicate(self, shares: Sequence[Scattered]) -> ReplicaSet:
        """Replicas for the devices that got a share, reusing the replica objects from earlier calls."""
        return self._replicator.replicate([s.slot for s in shares])

    def parallel_apply(self, replicas: ReplicaSet, shares: Sequence[Scattered]) -> list[Any]:
        """Run every replica on its share in its own worker thread."""
        state = ThreadState.capture(d.type for d in self.device_ids)
        streams = self._side_streams()
        chosen = None if streams is None else [streams[i] for i in replicas.rows]
        return parallel_apply(replicas.modules, shares, self._pool, state, chosen)

    def sync_buffers(self, replicas: ReplicaSet, shares: Sequence[Scattered]) -> None:
        """Bring buffer updates made in forward back to the module (see ``buffers``)."""
        total = sum(s.size for s in shares)
        weights = [s.size / total if total else 1.0 / len(shares) for s in shares]
        replicas.sync_buffers(weights, self.buffers_mode)

    def gather(self, outputs: Sequence[Any]) -> Any:
        """Concatenate the replicas' outputs on ``output_device``."""
        assert self.output_device is not None
        return gather(outputs, self.output_device, self.dim)

    # -- helpers ----------------------------------------------------------------------------------------------

    def check_module_device(self) -> None:
        """Raise if any parameter or buffer is not on ``device_ids[0]``."""
        src = self.device_ids[0]
        for name, t in chain(self.module.named_parameters(), self.module.named_buffers()):
            if t.device != src:
                kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
                raise DeviceError(
                    f"DataParallel expects the module on device_ids[0] = {src}, but {kind} {name!r} is on "
                    f"{t.device}; move the module there first with module.to({str(src)!r})"
                )

    def _side_streams(self) -> list[torch.cuda.Stream | None] | None:
        """One CUDA stream per replica slot on a GPU used by several slots; None when no GPU repeats."""
        if self._streams is None:
            cuda = [d for d in self.device_ids if d.type == "cuda"]
            if len(cuda) == len(set(cuda)):
                return None
            self._streams = [
                torch.cuda.Stream(d) if d.type == "cuda" and self.device_ids.count(d) > 1 else None
                for d in self.device_ids
            ]
        return self._streams
