"""A user's DataLoader whose batches one index operation can make: the fast path of ``Parallel.prepare``.

A DataLoader over a ``TensorDataset`` (or a ``Subset`` of one), with the default collation and no worker
processes, turns each list of indices its batch sampler yields into the stacked samples at those indices: one
``index_select`` per tensor. :func:`batched_view` recognises such a loader and returns a :class:`BatchedDataLoader`
(an :class:`~paratrain.loop.prepared.IndexedLoader`), so each process takes its share of every global batch straight
from tensors that sit on its device::

    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model, loader = par.prepare(model, loader)     # batches by indexing x and y on the device
    par.describe()                                 # says which path each prepared loader took

The batches are the DataLoader's, bit for bit, in its order: the index lists come from the loader's own batch
sampler, and every draw the DataLoader makes from the random generators at the start of an epoch is made here
too (its base seed, then the sampler's), so the generators end the epoch in the same state. A dataset with
``__getitems__`` (torch's batched fetch) gets this process's share fetched in one call and collated as the
DataLoader would. Anything else (transforms in ``__getitem__``, a custom ``collate_fn``, workers, iterable
datasets) stays a plain DataLoader.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

__all__ = ["BatchedDataLoader", "batched_view", "why_not_batched"]

# tensors of at most this share of a GPU's free memory are moved there whole; larger ones are indexed on the CPU
_DEVICE_SHARE = 0.5


def why_not_batched(loader: Any) -> str | None:
    """Why ``loader`` cannot be indexed batch by batch (None when it can)."""
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a torch DataLoader"
    if loader.num_workers:
        return f"{loader.num_workers} worker processes"
    if loader.batch_sampler is None:
        return "no batch sampler (batch_size=None)"
    if loader.collate_fn is not default_collate:
        return f"a custom collate_fn ({getattr(loader.collate_fn, '__name__', type(loader.collate_fn).__name__)})"
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return "an iterable dataset"
    if _tensors_of(dataset) is None and not callable(getattr(dataset, "__getitems__", None)):
        return f"a {type(dataset).__name__} that is indexed one sample at a time"
    return None


def batched_view(loader: Any) -> BatchedDataLoader | None:
    """The batch-indexed form of ``loader``, or None when it has none (see :func:`why_not_batched`)."""
    if why_not_batched(loader) is not None:
        return None
    found = _tensors_of(loader.dataset)
    if found is not None:
        tensors, rows = found
        return BatchedDataLoader(loader, tensors=tensors, rows=rows)
    return BatchedDataLoader(loader, getitems=loader.dataset.__getitems__)


def _tensors_of(dataset: Dataset[Any]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """A TensorDataset's tensors, and for a Subset (of a Subset...) of one the rows it selects; None otherwise."""
    rows: torch.Tensor | None = None
    while isinstance(dataset, Subset) and type(dataset).__getitem__ is Subset.__getitem__:
        picked = torch.as_tensor(list(dataset.indices), dtype=torch.int64)
        rows = picked if rows is None else picked[rows]
        dataset = dataset.dataset
    # a subclass that overrides __getitem__ may transform samples: only TensorDataset's own indexing is batched
    if isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__:
        return tuple(dataset.tensors), rows
    return None


class BatchedDataLoader:
    """A DataLoader's global batches as index tensors, and the batches made by indexing (an ``IndexedLoader``).

    Args:
        loader: the user's DataLoader (never changed).
        tensors: a TensorDataset's tensors (indexed directly), or None with ``getitems``.
        rows: the rows of ``tensors`` a Subset selects (None: all).
        getitems: the dataset's ``__getitems__`` (batched fetch), collated by the loader's ``collate_fn``.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        *,
        tensors: tuple[torch.Tensor, ...] | None = None,
        rows: torch.Tensor | None = None,
        getitems: Callable[[list[int]], Any] | None = None,
    ) -> None:
        self.loader = loader
        self.tensors = tensors
        self.rows = rows
        self.getitems = getitems
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self._drawn_alike: bool | None = None  # whether _drawn_order draws the sampler's order (None: not yet known)

    @property
    def path(self) -> str:
        """Which way batches are made, for ``Parallel.describe()``."""
        if self.tensors is not None:
            what = "a Subset of a TensorDataset" if self.rows is not None else "a TensorDataset"
            return f"indexed on {self.device} ({what}: one index_select per tensor and batch)"
        return f"fetched in one __getitems__ call per batch share ({type(self.loader.dataset).__name__})"

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        for holder in (self.loader, self.loader.sampler, self.loader.batch_sampler):
            set_epoch = getattr(holder, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def to(self, device: torch.device) -> BatchedDataLoader:
        """The same loader over tensors moved to ``device`` (when they fit there; else they stay)."""
        if self.tensors is None or not _fits(self.tensors, device):
            return self
        rows = self.rows.to(device) if self.rows is not None else None
        return BatchedDataLoader(self.loader, tensors=tuple(t.to(device) for t in self.tensors), rows=rows)

    def batch_indices(self, start: int = 0) -> Iterator[torch.Tensor]:
        """Each global batch of this epoch as an index tensor, drawn as the DataLoader draws them."""
        sampler = self.loader.batch_sampler
        batches = iter(sampler)  # type: ignore[arg-type]
        # the draw every DataLoader iteration makes first (its workers' base seed), so the generators stay in step
        torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)
        if isinstance(sampler, BatchSampler) and _chunks_in_order(sampler):
            # torch's BatchSampler over a sampler that draws from its own generator: its batches are consecutive
            # chunks of the sampler's order, taken here in one pass (C's loop over the ints) and sliced, as a hand
            # loop slices a permutation (9 us a batch of 64 for BatchSampler's Python loop, under 1 us a slice)
            order = self._order_of(sampler.sampler)
            size = sampler.batch_size
            stop = len(order) - len(order) % size if sampler.drop_last else len(order)
            for at in range(start * size, stop, size):
                yield order[at : at + size]
            return
        for b, indices in enumerate(batches):
            if b >= start:
                yield _index_tensor(indices)

    def _order_of(self, sampler: Any) -> torch.Tensor:
        """The sampler's whole order for this epoch, drawn as its ``__iter__`` draws it.

        A Random/SequentialSampler's order is made in tensors (:func:`_drawn_order`: 19 us a batch of 64 less than
        iterating its generator of ints here); the first epoch also iterates the sampler itself, from the same
        generator states, and keeps the faster way only if both give the same order (a torch whose sampler draws
        otherwise keeps the slow way, with the same batches)."""
        if self._drawn_alike:
            drawn = _drawn_order(sampler)
            if drawn is not None:
                return drawn
        if self._drawn_alike is None:
            own = getattr(sampler, "generator", None)
            states = torch.get_rng_state(), own.get_state() if own is not None else None
            drawn = _drawn_order(sampler)
            torch.set_rng_state(states[0])
            if own is not None:
                own.set_state(states[1])
            order = _index_tensor(list(sampler))
            self._drawn_alike = drawn is not None and torch.equal(drawn, order)
            return order
        return _index_tensor(list(sampler))

    def take(self, indices: torch.Tensor) -> Any:
        """The batch of the samples at ``indices``, as the DataLoader collates it (a list of tensors)."""
        if self.tensors is None:
            assert self.getitems is not None
            return self.loader.collate_fn(self.getitems(indices.tolist()))
        where = indices if indices.device == self.device else indices.to(self.device, non_blocking=True)
        if self.rows is not None:
            where = self.rows.index_select(0, where)
        return [t.index_select(0, where) for t in self.tensors]


def _chunks_in_order(sampler: BatchSampler) -> bool:
    """Whether ``sampler``'s batches are consecutive chunks of its sampler's whole order, drawn at the epoch's start.

    torch's own BatchSampler (a subclass may batch otherwise) over a SequentialSampler, or a RandomSampler (whose
    only draw from the global RNG is its seed, when its iteration starts; the rest come from its own generator,
    so taking the whole order at once draws what the DataLoader draws, in the same order)."""
    return (
        type(sampler) is BatchSampler
        and type(sampler.sampler) in (RandomSampler, SequentialSampler)
        and isinstance(sampler.batch_size, int)
        and sampler.batch_size > 0
    )


def _drawn_order(sampler: Any) -> torch.Tensor | None:
    """A SequentialSampler's order, or a RandomSampler's without replacement, drawn in tensors from the generators
    its ``__iter__`` draws from, in the same calls (a seed from the global RNG when it has no generator of its own,
    one permutation per pass over the data, and one more cut to the rest); None for any other sampler."""
    if type(sampler) is SequentialSampler:
        return torch.arange(len(sampler.data_source), dtype=torch.int64)
    if type(sampler) is not RandomSampler or sampler.replacement:
        return None
    n = len(sampler.data_source)
    generator = sampler.generator
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    passes = [torch.randperm(n, generator=generator) for _ in range(sampler.num_samples // n)]
    passes.append(torch.randperm(n, generator=generator)[: sampler.num_samples % n])
    return torch.cat(passes)


def _index_tensor(indices: Any) -> torch.Tensor:
    """A batch sampler's list of ints as an int64 tensor, through an ``array`` (C's loop over the list): under a
    quarter of ``torch.as_tensor``'s time on a list of 64 (3.3 against 14.7 us here), once per step."""
    if type(indices) is list:
        try:
            return torch.frombuffer(array.array("q", indices), dtype=torch.int64)
        except (TypeError, ValueError, OverflowError):  # not ints (array refuses them), or empty (frombuffer does)
            pass
    return torch.as_tensor(indices, dtype=torch.int64)


def _fits(tensors: tuple[torch.Tensor, ...], device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return sum(t.numel() * t.element_size() for t in tensors) <= _DEVICE_SHARE * free
