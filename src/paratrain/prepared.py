"""Loaders after ``Parallel.prepare``: this process's share of each global batch, on the right device.

Two kinds: paratrain's :class:`~paratrain.loader.DeviceLoader` (data already in tensors: this process indexes
its share directly) and any other iterable of batches, such as a user's ``torch.utils.data.DataLoader``
(every process reads the same global batch and keeps its slice, so results match one device exactly).
Both record the local and global sample counts of the latest batch, which ``Parallel.backward`` uses to
weight the loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import RandomSampler

from .loader import DeviceLoader
from .strategies import Strategy
from .tree import flatten, unflatten

__all__ = ["BatchSizes", "PreparedDeviceLoader", "PreparedLoader"]


@dataclass
class BatchSizes:
    """Samples in the latest batch: this process's share and the whole global batch."""

    local: int = 0
    total: int = 0


class PreparedDeviceLoader:
    """A DeviceLoader whose data lives on the strategy's device and yields this process's share."""

    def __init__(self, loader: DeviceLoader, strategy: Strategy, sizes: BatchSizes) -> None:
        self.loader = loader.to(strategy.device)
        self.strategy = strategy
        self.sizes = sizes
        self._start = 0

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def num_samples(self) -> int:
        return self.loader.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def skip(self, batches: int) -> None:
        """The next iteration starts at batch ``batches`` of the current epoch (resuming mid-epoch)."""
        self._start = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, self._start = self._start, 0
        data = self.loader.data
        for indices in self.loader.batch_indices(start):
            mine = self.strategy.shard(indices)
            self.sizes.local, self.sizes.total = int(mine.numel()), int(indices.numel())
            yield data.inputs.index_select(0, mine), data.targets.index_select(0, mine)


class PreparedLoader:
    """Any iterable of batches: each batch moved to the device and cut to this process's share."""

    def __init__(self, loader: Iterable[Any], strategy: Strategy, sizes: BatchSizes) -> None:
        self.loader = loader
        self.strategy = strategy
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        for holder in (self.loader, getattr(self.loader, "sampler", None)):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def _same_order_everywhere(self) -> None:
        """Every process must see the same global batches: the shuffle order comes from rank 0.

        A DataLoader's RandomSampler without a generator draws its seed from the global RNG, which drifts
        apart across processes as soon as they draw different amounts of randomness (dropout on slices of
        different sizes, say).
        """
        sampler = getattr(self.loader, "sampler", None)
        if self.strategy.world_size == 1 or not isinstance(sampler, RandomSampler):
            return
        seed = int(torch.empty((), dtype=torch.int64).random_().item()) if self.strategy.is_main else 0
        generator = sampler.generator if sampler.generator is not None else torch.Generator()
        sampler.generator = generator.manual_seed(int(self.strategy.broadcast_object(seed)))

    def __iter__(self) -> Iterator[Any]:
        device = self.strategy.device
        self._same_order_everywhere()
        for batch in self.loader:
            leaves, spec = flatten(batch)
            sized = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
            total = int(sized[0].shape[0]) if sized else 0
            mine = self.strategy.shard(torch.arange(total))  # a contiguous slice of the global batch
            start, count = (int(mine[0]), int(mine.numel())) if mine.numel() else (0, 0)
            moved = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    if leaf.dim() > 0 and count != total:
                        leaf = leaf.narrow(0, start, count)
                    leaf = leaf.to(device, non_blocking=True)
                moved.append(leaf)
            self.sizes.local, self.sizes.total = count, total
            yield unflatten(moved, spec)
