"""Shuffled mini-batches formed by indexing tensors that already live on the training device.

The seeds' loop spends its time in per-sample Python (a DataLoader calling transforms one image at a time). Here the
whole split sits on the device and each batch is one ``index_select``::

    loader = DeviceLoader(load_dataset("digits").train.to("cuda"), batch_size=64, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)                  # the order is a pure function of (seed, epoch)
        for inputs, targets in loader:           # (64, 1, 28, 28), (64,) on cuda
            ...

    loader.skip(120); loader.set_epoch(3)        # resume: the next pass starts at batch 120 of epoch 3

It follows the engine's :class:`~paratrain.loop.prepared.IndexedLoader` protocol (``batch_indices``, ``take``, ``to``),
so ``Parallel.prepare`` has each process index its own share of every global batch on its device.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from paratrain.errors import ConfigError
from paratrain.training.data import TensorData

__all__ = ["DeviceLoader"]

_EPOCH_STRIDE = 1_000_003  # a prime, so (seed, epoch) pairs of everyday sizes map to distinct generator seeds


class DeviceLoader:
    """Shuffled mini-batches of a TensorData, formed by indexing on the data's device.

    Args:
        data: the split; batches come out on the device its tensors are on.
        batch_size: samples per global batch.
        shuffle: a fresh permutation each epoch; ``False`` keeps the order 0..N-1.
        seed: with the epoch, decides the permutation; loaders with equal seeds give identical batches.
        drop_last: leave out the last batch when it would be smaller than ``batch_size``.

    Raises:
        ConfigError: a batch size below one, empty data, tensors on different devices, or ``drop_last`` with
            fewer samples than one batch.
    """

    def __init__(
        self, data: TensorData, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, found {batch_size!r}; pass 1 or more")
        if len(data) == 0:
            raise ConfigError("the data has no samples; a DeviceLoader needs at least one (check the dataset split)")
        if data.inputs.device != data.targets.device:
            raise ConfigError(
                f"inputs are on {data.inputs.device} but targets on {data.targets.device}; move both with "
                f"data.to(device) so batches can be indexed in one place"
            )
        if drop_last and len(data) < batch_size:
            raise ConfigError(
                f"drop_last=True with batch_size {batch_size} but only {len(data)} samples gives no batches; "
                f"lower the batch size or pass drop_last=False"
            )
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._skip = 0

    @property
    def num_samples(self) -> int:
        """Samples in the data (every epoch visits each once, less the dropped tail with ``drop_last``)."""
        return len(self.data)

    @property
    def epoch(self) -> int:
        """The epoch whose permutation the next pass uses."""
        return self._epoch

    def to(self, device: torch.device | str | int) -> DeviceLoader:
        """The same loader (settings, epoch, pending skip) over the data moved to ``device``."""
        moved = DeviceLoader(
            self.data.to(device), self.batch_size, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last
        )
        moved._epoch, moved._skip = self._epoch, self._skip
        return moved

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from now on (call it before each epoch, like DistributedSampler)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"epoch must be a non-negative int, found {epoch!r}")
        self._epoch = epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def skip(self, batches: int) -> None:
        """Start the next pass at batch ``batches`` of the current epoch (resume mid-epoch); later ones start at 0."""
        self._check_start(batches, "skip")
        self._skip = batches

    def permutation(self) -> torch.Tensor:
        """The current epoch's sample order, (N,) int64 on the data's device."""
        n = self.num_samples
        if self.shuffle:
            # a CPU generator, so the order is the same on every device type and every rank
            generator = torch.Generator().manual_seed(self.seed + self._epoch * _EPOCH_STRIDE)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        return order.to(self.data.inputs.device)

    def batch_indices(self, start: int = 0) -> Iterator[torch.Tensor]:
        """The index tensor of each global batch of the current epoch, from batch ``start`` on."""
        self._check_start(start, "start")
        return self._batch_indices(self.permutation(), start)

    def _batch_indices(self, order: torch.Tensor, start: int) -> Iterator[torch.Tensor]:
        for b in range(start, len(self)):
            yield order[b * self.batch_size : (b + 1) * self.batch_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs, targets)`` of each global batch, on the data's device."""
        # read and reset the skip here, not inside the generator, so it applies to exactly this pass even when the
        # iterator is created before it is first advanced
        start, self._skip = self._skip, 0
        return self._batches(self.batch_indices(start))

    def _batches(self, indices: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in indices:
            yield self.take(idx)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of the samples at ``indices``, on the data's device."""
        return self.data.inputs.index_select(0, indices), self.data.targets.index_select(0, indices)

    def _check_start(self, start: int, what: str) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(self):
            raise ConfigError(
                f"{what} must be a batch number from 0 to {len(self)} (the batches per epoch), found {start!r}"
            )
