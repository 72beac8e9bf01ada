"""The fast path for a user's DataLoader: the DataLoader's batches, bit for bit, by one index operation each."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_collate

import paratrain
from paratrain.loop.batched import _drawn_order, batched_view, why_not_batched

N = 103  # not a multiple of the batch: the last batch is short


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, 4, generator=g), torch.randint(0, 5, (N,), generator=g), torch.arange(N))


class _Reversed(BatchSampler):
    """A batch sampler of its own: its batches are not chunks of the sampler's order (batched the slow way)."""

    def __iter__(self):
        for batch in super().__iter__():
            yield batch[::-1]


LOADERS = {
    "shuffled, global RNG": lambda d: DataLoader(d, batch_size=8, shuffle=True),
    "shuffled, own generator": lambda d: DataLoader(
        d, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    ),
    "in order, drop_last": lambda d: DataLoader(d, batch_size=10, drop_last=True),
    "shuffled, drop_last, uneven": lambda d: DataLoader(d, batch_size=7, shuffle=True, drop_last=True),
    "shuffled, a last short batch": lambda d: DataLoader(d, batch_size=7, shuffle=True),
    "random with replacement": lambda d: DataLoader(
        d, batch_size=6, sampler=RandomSampler(d, replacement=True, num_samples=250)
    ),
    "random, fewer samples than the data": lambda d: DataLoader(
        d, batch_size=9, sampler=RandomSampler(d, num_samples=40)
    ),
    "a BatchSampler subclass": lambda d: DataLoader(d, batch_sampler=_Reversed(SequentialSampler(d), 8, False)),
    "weighted sampler": lambda d: DataLoader(d, batch_size=7, sampler=WeightedRandomSampler(torch.ones(N), 50)),
    "a Subset of a Subset": lambda d: DataLoader(
        Subset(Subset(d, list(range(5, 95))), list(range(80, 0, -2))), batch_size=6, shuffle=True
    ),
}


def _epoch(loader, seed: int) -> tuple[list, torch.Tensor]:
    torch.manual_seed(seed)
    batches = list(loader)
    return batches, torch.get_rng_state()


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w) and len(g) == len(w)
        for a, b in zip(g, w, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu")])
def test_the_batches_and_the_generators_are_the_dataloaders(kind, strategy, devices):
    data = _data()
    reference = LOADERS[kind](data)
    want, rng_after = _epoch(reference, seed=11)
    want_next, _ = _epoch(reference, seed=12)  # a second epoch: a loader's own generator has moved on
    with paratrain.Parallel(strategy, devices) as par:
        prepared = par.prepare(LOADERS[kind](data))
        assert prepared.path.startswith("indexed on cpu"), prepared.path
        got, rng = _epoch(prepared, seed=11)
        got_next, _ = _epoch(prepared, seed=12)
    _assert_same(got, want)
    _assert_same(got_next, want_next)
    assert torch.equal(rng, rng_after)  # the same draws from the global generator


def test_resuming_mid_epoch_skips_batches_in_the_same_order():
    data = _data()
    want, _ = _epoch(LOADERS["shuffled, global RNG"](data), seed=2)
    with paratrain.Parallel("single", "cpu") as par:
        prepared = par.prepare(LOADERS["shuffled, global RNG"](data))
        prepared.skip(5)
        got, _ = _epoch(prepared, seed=2)
    _assert_same(got, want[5:])


class Squared(TensorDataset):
    """A TensorDataset whose samples are transformed: its own __getitem__ must run, one sample at a time."""

    def __getitem__(self, index):
        x, *rest = super().__getitem__(index)
        return (x * x, *rest)


class Batched(Dataset):
    """A dataset with torch's batched fetch."""

    def __init__(self) -> None:
        self.x = torch.randn(N, 2)
        self.calls: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, index):
        return self.x[index], index

    def __getitems__(self, indices):
        self.calls.append(len(indices))
        return [(self.x[i], i) for i in indices]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: DataLoader(_data(), batch_size=4, collate_fn=lambda b: default_collate(b)), "custom collate_fn"),
        (lambda: DataLoader(_data(), batch_size=4, num_workers=2), "2 worker processes"),
        (lambda: DataLoader(Squared(*_data().tensors), batch_size=4), "Squared that is indexed one sample at a time"),
        (lambda: DataLoader(Stream(), batch_size=2), "an iterable dataset"),
        (lambda: DataLoader(_data(), batch_size=None), "no batch sampler"),
        (lambda: [torch.zeros(2)], "a list, not a torch DataLoader"),
    ],
)
def test_everything_else_stays_a_dataloader_and_says_why(make, reason):
    loader = make()
    assert reason in why_not_batched(loader) and batched_view(loader) is None
    with paratrain.Parallel("single", "cpu") as par:
        assert reason in par.prepare(loader).path and "iterated as given" in par.prepare(loader).path


def test_a_transforming_dataset_keeps_its_transform():
    data = _data()
    squared = Squared(*data.tensors)
    with paratrain.Parallel("single", "cpu") as par:
        x, _, _ = next(iter(par.prepare(DataLoader(squared, batch_size=4))))
    assert torch.equal(x, data.tensors[0][:4] ** 2)


def test_a_dataset_with_getitems_is_fetched_in_one_call_per_batch():
    dataset = Batched()
    want, _ = _epoch(DataLoader(dataset, batch_size=10, shuffle=True), seed=4)
    dataset.calls.clear()
    with paratrain.Parallel("single", "cpu") as par:
        prepared = par.prepare(DataLoader(dataset, batch_size=10, shuffle=True))
        assert "__getitems__" in prepared.path
        got, _ = _epoch(prepared, seed=4)
    _assert_same(got, want)
    assert dataset.calls == [10] * (N // 10) + [N % 10]


def test_describe_names_each_loaders_path():
    with paratrain.Parallel("single", "cpu") as par:
        fast = par.prepare(DataLoader(_data(), batch_size=4))
        slow = par.prepare(DataLoader(_data(), batch_size=4, collate_fn=list))
        text = par.describe(loaders=True)
        assert par.describe() == "single on cpu"
        assert f"loader 1: {fast.path}" in text and f"loader 2: {slow.path}" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda d: SequentialSampler(d),
        lambda d: RandomSampler(d),
        lambda d: RandomSampler(d, generator=torch.Generator().manual_seed(5)),
        lambda d: RandomSampler(d, num_samples=40),
        lambda d: RandomSampler(d, num_samples=2 * N + 17),
        lambda d: RandomSampler(d, num_samples=2 * N),
    ],
    ids=["sequential", "random", "own generator", "fewer samples", "more samples", "two passes"],
)
def test_the_order_drawn_in_tensors_is_the_samplers_with_the_same_draws(make):
    """The fast path's order: the sampler's own iteration, drawn from the same generators (their states after it
    equal too), over three epochs."""
    data = _data()
    mine, theirs = make(data), make(data)
    for epoch in range(3):
        torch.manual_seed(40 + epoch)
        want = list(theirs)
        rng_after = torch.get_rng_state()
        torch.manual_seed(40 + epoch)
        got = _drawn_order(mine)
        assert got is not None and got.tolist() == want, epoch
        assert torch.equal(torch.get_rng_state(), rng_after)
        if getattr(mine, "generator", None) is not None:
            assert torch.equal(mine.generator.get_state(), theirs.generator.get_state())


def test_other_samplers_have_no_order_drawn_in_tensors():
    data = _data()
    assert _drawn_order(RandomSampler(data, replacement=True)) is None
    assert _drawn_order(WeightedRandomSampler(torch.ones(N), 50)) is None
    assert _drawn_order(_Reversed(SequentialSampler(data), 8, False)) is None
