"""Loaders after ``Parallel.prepare``: this process's share of each global batch, on the right device.

Two kinds: a loader that follows the :class:`IndexedLoader` protocol (its global batches are index tensors into
data it can move to a device, so each process indexes its share directly: paratrain's own ``DeviceLoader``, and a
user's DataLoader over a ``TensorDataset`` through :mod:`paratrain.loop.batched`), and any other iterable of batches,
such as a DataLoader with transforms (every process reads the same global batch and keeps its slice, so results
match one device exactly). Each prepared loader's :attr:`path` says which it took.

Every batch they yield is recorded with its :class:`BatchShare` (this process's samples and the global batch's) in
the :class:`BatchLedger` of the ``Parallel`` that prepared them; the forward that batch is fed to binds the share
there, and ``Parallel.backward`` turns it into the loss weight of the step.

A loader's batch is the global batch under every strategy, where torch's DistributedSampler makes ``batch_size``
each process's: under several processes the main process says so once per loader, with the number to give for
the per-process batch a torch DDP script had.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DistributedSampler

from paratrain.dp.scatter_gather import batch_size
from paratrain.errors import ConfigError
from paratrain.loop.batched import batched_view, why_not_batched
from paratrain.strategies import Strategy
from paratrain.tree import flatten, unflatten

__all__ = [
    "BatchLedger",
    "BatchShare",
    "IndexedLoader",
    "PreparedIndexedLoader",
    "PreparedLoader",
    "Recording",
    "global_batch_note",
    "prepare_loader",
]


@dataclass(frozen=True)
class BatchShare:
    """Samples of one global batch: this process's share (``local``) and the whole batch (``total``)."""

    local: int
    total: int


@runtime_checkable
class IndexedLoader(Protocol):
    """What a loader offers to be sharded on the device: global batches as index tensors, and the indexing.

    ``batch_indices(start)`` yields each global batch of the current epoch (from batch ``start`` on) as a 1-d
    index tensor; ``take(indices)`` returns the batch made of those samples; ``to(device)`` returns the same
    loader (settings, epoch) over data on ``device``.
    """

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def to(self, device: torch.device) -> IndexedLoader: ...

    def batch_indices(self, start: int = 0) -> Iterator[torch.Tensor]: ...

    def take(self, indices: torch.Tensor) -> Any: ...


class BatchLedger:
    """One ``Parallel``'s book of batches: which came last, and the share the next backward weighs its loss by."""

    def __init__(self) -> None:
        self._yielded = 0  # batches recorded so far: orders batches across this Parallel's loaders
        self._bound: tuple[BatchShare | None, float] | None = None

    def tick(self) -> int:
        """The number of the batch being recorded now (1 for the first)."""
        self._yielded += 1
        return self._yielded

    def bind(self, share: BatchShare | None, fraction: float) -> None:
        """A forward ran on (``fraction`` of) this process's ``share`` of a global batch: its backward weighs so."""
        self._bound = (share, fraction)

    def unbind(self) -> None:
        self._bound = None

    def take(self) -> tuple[BatchShare | None, float]:
        """What the latest forward bound (and forget it): ``(None, 1.0)`` when nothing did."""
        bound, self._bound = self._bound, None
        return bound or (None, 1.0)


class Recording:
    """The share of the latest batch a loader yielded, and weak references to that batch's tensors.

    ``fraction`` is the part of the share the batch is: 1 for a loader's batch, a micro-batch's samples over
    the share's for ``Parallel.accumulate``.
    """

    def __init__(self, ledger: BatchLedger) -> None:
        self.ledger = ledger
        self.share: BatchShare | None = None
        self.fraction = 1.0
        self.order = 0  # when the batch was yielded, among every batch of the ledger's loaders
        self._tensors: list[weakref.ref[torch.Tensor]] = []

    def record(self, batch: Any, share: BatchShare | None, fraction: float = 1.0) -> None:
        plain = type(batch) in (list, tuple) and all(isinstance(t, torch.Tensor) for t in batch)
        leaves = batch if plain else flatten(batch)[0]  # (inputs, targets): no tree walk
        self._tensors = [weakref.ref(t) for t in leaves if isinstance(t, torch.Tensor)]
        self.share = share
        self.fraction = fraction
        self.order = self.ledger.tick()

    def record_tensors(self, batch: list[torch.Tensor], share: BatchShare) -> None:
        """:meth:`record` of a batch that is a list of tensors (an indexed loader's), a whole share."""
        self._tensors = [weakref.ref(t) for t in batch]
        self.share = share
        self.fraction = 1.0
        self.order = self.ledger.tick()

    def clear(self) -> None:
        """Forget the latest batch (it is no candidate for the next forward any more)."""
        self.share, self.fraction, self.order, self._tensors = None, 1.0, 0, []

    def owns(self, tensors: list[torch.Tensor]) -> bool:
        """True when one of ``tensors`` is a tensor of the latest batch (fed to a model unchanged)."""
        mine = [ref() for ref in self._tensors]
        return any(t is m for t in tensors for m in mine if m is not None)


def idle_processes(batch_size: int, processes: int) -> str | None:
    """What a global batch smaller than the number of processes means, in a sentence; None when every process
    gets samples.

    idle_processes(4, 6)
    # 'global batch 4 on 6 processes: 2 of them get no samples each step (they only wait for the others), and
    #  the batch keeps at most 4 processes busy'
    """
    if batch_size >= processes:
        return None
    idle = processes - batch_size
    return (
        f"global batch {batch_size} on {processes} processes: {idle} of them get no samples each step (they only "
        f"wait for the others), and the batch keeps at most {batch_size} process{'es' * (batch_size != 1)} busy"
    )


def global_batch_note(loader: Iterable[Any], processes: int) -> str:
    """What ``prepare`` says about a loader's batch under ``processes`` processes: it is the global batch.

    global_batch_note(DataLoader(data, batch_size=32), 2)
    # 'batch 32 is the global batch: 16 per process on 2 processes; for 32 per process give 64'
    """
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        return (
            f"each batch the loader yields is the global batch, cut into {processes} shares (one per process); for "
            f"a given batch per process, yield {processes} times as many samples"
        )
    low, high = size // processes, -(-size // processes)
    share = f"{low}" if low == high else f"{low} or {high}"
    idle = idle_processes(size, processes)
    return (
        f"batch {size} is the global batch: {share} per process on {processes} processes; for {size} per process "
        f"give {size * processes}" + (f" (warning: {idle})" if idle else "")
    )


def prepare_loader(
    loader: Iterable[Any], strategy: Strategy, ledger: BatchLedger
) -> PreparedIndexedLoader | PreparedLoader:
    """The prepared form of ``loader``: indexed on the device when it follows :class:`IndexedLoader`, or when it is
    a DataLoader :mod:`paratrain.loop.batched` can index batch by batch; otherwise iterated as it is."""
    if isinstance(loader, IndexedLoader):
        return PreparedIndexedLoader(loader, strategy, ledger)
    _refuse_distributed_sampler(loader, strategy)
    if strategy.world_size > 1 and strategy.is_main:  # a user's loader: its batch_size is the global batch
        print(f"paratrain: {global_batch_note(loader, strategy.world_size)}", file=sys.stderr, flush=True)
    batched = batched_view(loader)
    if batched is not None:
        return PreparedIndexedLoader(batched, strategy, ledger, lend_rng=True)
    return PreparedLoader(loader, strategy, ledger, why=why_not_batched(loader))


def _refuse_distributed_sampler(loader: Any, strategy: Strategy) -> None:
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    if strategy.world_size > 1 and any(isinstance(s, DistributedSampler) for s in samplers):
        raise ConfigError(
            "prepare() got a DataLoader with a DistributedSampler, which already gives each process its own "
            "batches; prepare() cuts every global batch into the processes' shares itself. Pass a loader "
            "over the whole dataset (shuffle=True, or a RandomSampler)"
        )


def _in_step(strategy: Strategy, batches: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """``batches()``, started with rank 0's global RNG state in every process (see :class:`PreparedLoader`).

    The draws that decide an epoch's order (a sampler's seed, a DataLoader's base seed) come from the global RNG
    when the iteration begins; every process makes them with rank 0's generator state, lent until the first batch
    is out, so every process sees the batches one process with that state sees. Rank 0's own generator advances
    as it would in one process.
    """
    if strategy.world_size == 1:
        return batches()
    shared = strategy.broadcast(torch.get_rng_state())
    own = torch.get_rng_state()
    torch.set_rng_state(shared)
    try:
        started = batches()
        first = list(itertools.islice(started, 1))
    finally:
        if not strategy.is_main:
            torch.set_rng_state(own)
    return itertools.chain(first, started)


class PreparedIndexedLoader:
    """An :class:`IndexedLoader` whose data lives on the strategy's device and yields this process's share."""

    def __init__(
        self, loader: IndexedLoader, strategy: Strategy, ledger: BatchLedger, *, lend_rng: bool = False
    ) -> None:
        self.loader = loader.to(strategy.device)
        self.strategy = strategy
        self.recording = Recording(ledger)
        self._start = 0
        self._lend_rng = lend_rng  # the loader draws its order from the global RNG (a user's DataLoader)

    @property
    def path(self) -> str:
        """How batches are made: for ``Parallel.describe()``."""
        described = getattr(self.loader, "path", None)
        return (
            str(described)
            if described is not None
            else f"indexed on {self.strategy.device} ({type(self.loader).__name__})"
        )

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def share(self) -> BatchShare | None:
        """The share of the batch yielded last (None before the first)."""
        return self.recording.share

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def skip(self, batches: int) -> None:
        """The next iteration starts at batch ``batches`` of the current epoch (resuming mid-epoch)."""
        self._start = batches

    def __iter__(self) -> Iterator[Any]:
        start, self._start = self._start, 0
        strategy, loader = self.strategy, self.loader
        record, record_tensors = self.recording.record, self.recording.record_tensors
        indices_of = (lambda: loader.batch_indices(start)) if self._lend_rng else None
        batches = _in_step(strategy, indices_of) if indices_of is not None else loader.batch_indices(start)
        shares: dict[tuple[int, int], BatchShare] = {}  # the few sizes an epoch has, made once
        for indices in batches:
            mine = strategy.shard(indices)
            batch = loader.take(mine)
            sizes = (mine.numel(), indices.numel())
            share = shares.get(sizes)
            if share is None:
                share = shares[sizes] = BatchShare(*sizes)
            if type(batch) is list and all(type(t) is torch.Tensor for t in batch):
                record_tensors(batch, share)
            else:
                record(batch, share)
            yield batch


class PreparedLoader:
    """Any iterable of batches: each batch moved to the device and cut to this process's share.

    Under several processes every process iterates the same loader and must see the same global batches, in
    the order one process would see them. A sampler with its own ``generator`` gives that by itself (the
    generator is the same in every process); one without draws from the global RNG, which drifts apart across
    processes (dropout on shares of different sizes, say). So each epoch's iteration starts with rank 0's
    global RNG state lent to every process; the user's loader and sampler are never changed.
    """

    def __init__(
        self, loader: Iterable[Any], strategy: Strategy, ledger: BatchLedger, *, why: str | None = None
    ) -> None:
        _refuse_distributed_sampler(loader, strategy)
        self.loader = loader
        self.strategy = strategy
        self.recording = Recording(ledger)
        self._why = why  # why it could not be indexed batch by batch

    @property
    def path(self) -> str:
        """How batches are made: for ``Parallel.describe()``."""
        reason = f": {self._why}" if self._why else ""
        return f"iterated as given, each batch moved to {self.strategy.device} and cut to this process's share{reason}"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def share(self) -> BatchShare | None:
        """The share of the batch yielded last (None before the first)."""
        return self.recording.share

    def set_epoch(self, epoch: int) -> None:
        for holder in (self.loader, getattr(self.loader, "sampler", None)):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def _global_batches(self) -> Iterator[Any]:
        return _in_step(self.strategy, lambda: iter(self.loader))

    def __iter__(self) -> Iterator[Any]:
        device = self.strategy.device
        for batch in self._global_batches():
            leaves, spec = flatten(batch)
            total = batch_size(leaves, spec) or 0
            mine = self.strategy.shard(torch.arange(total))  # a contiguous slice of the global batch
            start, count = (int(mine[0]), int(mine.numel())) if mine.numel() else (0, 0)
            moved = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    if leaf.dim() > 0 and count != total:
                        leaf = leaf.narrow(0, start, count)
                    leaf = leaf.to(device, non_blocking=True)
                moved.append(leaf)
            share = unflatten(moved, spec)
            self.recording.record(share, BatchShare(count, total))
            yield share
