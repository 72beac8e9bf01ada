from __future__ import annotations

import pytest
import torch

from paratrain.dp.scatter_gather import shard, split_sizes
from paratrain.errors import ConfigError
from paratrain.training.data import TensorData
from paratrain.training.datasets import load_dataset
from paratrain.training.loader import DeviceLoader


def numbered(n: int) -> TensorData:
    """Sample i has input [i, -i] and target i, so a batch's targets are its indices."""
    i = torch.arange(n)
    return TensorData(torch.stack([i, -i], dim=1).float(), i)


def epoch_targets(loader: DeviceLoader) -> list[list[int]]:
    return [targets.tolist() for _, targets in loader]


def test_batches_are_the_indexed_samples():
    data = load_dataset("digits").train
    loader = DeviceLoader(data, batch_size=100, seed=7)
    assert loader.num_samples == 1437 and len(loader) == 15
    for (inputs, targets), idx in zip(loader, loader.batch_indices(), strict=True):
        assert torch.equal(inputs, data.inputs[idx]) and torch.equal(targets, data.targets[idx])
        assert inputs.shape[1:] == (1, 28, 28)


def test_every_epoch_visits_each_sample_exactly_once():
    loader = DeviceLoader(numbered(103), batch_size=10, seed=1)
    for epoch in range(3):
        loader.set_epoch(epoch)
        seen = torch.cat([targets for _, targets in loader])
        assert sorted(seen.tolist()) == list(range(103))
        assert torch.equal(torch.cat(list(loader.batch_indices())), loader.permutation())


def test_the_order_is_a_pure_function_of_seed_and_epoch():
    a = DeviceLoader(numbered(50), batch_size=8, seed=3)
    b = DeviceLoader(numbered(50), batch_size=8, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert epoch_targets(a) == epoch_targets(b)
    first = epoch_targets(a)
    a.set_epoch(3)
    assert epoch_targets(a) != first  # a new epoch, a new order
    a.set_epoch(2)
    assert epoch_targets(a) == first  # and going back reproduces it
    other_seed = DeviceLoader(numbered(50), batch_size=8, seed=4)
    other_seed.set_epoch(2)
    assert epoch_targets(other_seed) != first


def test_global_rng_state_does_not_change_the_order():
    loader = DeviceLoader(numbered(40), batch_size=8, seed=0)
    torch.manual_seed(1)
    first = epoch_targets(loader)
    torch.manual_seed(2)
    assert epoch_targets(loader) == first


def test_without_shuffle_the_order_is_the_data_order():
    loader = DeviceLoader(numbered(10), batch_size=4, shuffle=False)
    assert epoch_targets(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize(
    "n, batch_size, drop_last, sizes",
    [
        (10, 3, False, [3, 3, 3, 1]),  # like DataLoader: the last batch may be smaller
        (10, 3, True, [3, 3, 3]),
        (9, 3, False, [3, 3, 3]),
        (9, 3, True, [3, 3, 3]),
        (5, 8, False, [5]),
        (1, 1, False, [1]),
    ],
)
def test_batch_count_and_sizes(n, batch_size, drop_last, sizes):
    loader = DeviceLoader(numbered(n), batch_size, drop_last=drop_last)
    assert len(loader) == len(sizes)
    assert [len(t) for t in epoch_targets(loader)] == sizes


def test_drop_last_leaves_out_only_the_tail_of_the_permutation():
    full = DeviceLoader(numbered(10), 3, seed=5)
    dropped = DeviceLoader(numbered(10), 3, seed=5, drop_last=True)
    assert epoch_targets(dropped) == epoch_targets(full)[:3]


def test_skip_resumes_with_the_tail_of_the_uninterrupted_epoch():
    reference = DeviceLoader(numbered(50), batch_size=7, seed=9)
    reference.set_epoch(4)
    uninterrupted = epoch_targets(reference)
    resumed = DeviceLoader(numbered(50), batch_size=7, seed=9)  # a fresh process after a checkpoint
    resumed.set_epoch(4)
    resumed.skip(3)
    assert epoch_targets(resumed) == uninterrupted[3:]
    assert epoch_targets(resumed) == uninterrupted  # the skip applied to one pass only
    assert [t.tolist() for t in resumed.batch_indices(5)] == uninterrupted[5:]
    resumed.skip(len(resumed))  # resuming exactly at the end of an epoch: nothing left of it
    assert epoch_targets(resumed) == []


def test_skip_belongs_to_the_first_iterator_made_after_it():
    loader = DeviceLoader(numbered(20), batch_size=5, seed=0)
    whole = epoch_targets(loader)
    loader.skip(2)
    resumed = iter(loader)  # made before it is advanced: still the resumed pass
    fresh = iter(loader)
    assert [t.tolist() for _, t in resumed] == whole[2:]
    assert [t.tolist() for _, t in fresh] == whole


def test_bad_arguments_say_what_was_expected():
    data = numbered(10)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match=r"batch_size must be a positive int, found"):
            DeviceLoader(data, bad)
    with pytest.raises(ConfigError, match="the data has no samples"):
        DeviceLoader(numbered(0), 4)
    with pytest.raises(ConfigError, match=r"drop_last=True with batch_size 16 but only 10 samples gives no batches"):
        DeviceLoader(data, 16, drop_last=True)
    loader = DeviceLoader(data, 4)
    with pytest.raises(
        ConfigError, match=r"skip must be a batch number from 0 to 3 \(the batches per epoch\), found 4"
    ):
        loader.skip(4)
    with pytest.raises(ConfigError, match=r"start must be a batch number from 0 to 3"):
        loader.batch_indices(-1)
    with pytest.raises(ConfigError, match=r"epoch must be a non-negative int, found -1"):
        loader.set_epoch(-1)


def test_to_keeps_the_settings_epoch_and_pending_skip():
    loader = DeviceLoader(numbered(30), batch_size=4, seed=6, drop_last=True)
    loader.set_epoch(2)
    expected = epoch_targets(loader)
    loader.skip(3)
    moved = loader.to("cpu")
    assert moved is not loader and (moved.epoch, len(moved)) == (2, 7)
    assert epoch_targets(moved) == expected[3:]
    assert epoch_targets(moved) == expected


def test_batches_stay_on_the_data_device():
    loader = DeviceLoader(numbered(12).to("meta"), batch_size=5)  # a device other than the permutation's CPU
    inputs, targets = next(iter(loader))
    assert inputs.device.type == "meta" and targets.device.type == "meta"
    assert inputs.shape == (5, 2) and targets.shape == (5,)


# --- shard ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, world_size, sizes",
    [
        (10, 3, [4, 3, 3]),
        (2, 3, [1, 1, 0]),  # fewer samples than ranks: the last ranks get nothing, and no error
        (0, 2, [0, 0]),
        (7, 1, [7]),
        (30, 4, [8, 8, 7, 7]),
        (64, 3, [22, 21, 21]),
    ],
)
def test_shard_table(batch, world_size, sizes):
    indices = torch.arange(100, 100 + batch)
    shards = [shard(indices, rank, world_size) for rank in range(world_size)]
    assert [len(s) for s in shards] == sizes
    assert torch.equal(torch.cat(shards), indices)  # contiguous, in rank order
    if batch >= world_size:
        assert sizes == split_sizes(batch, world_size)  # the same split DataParallel's scatter makes


def test_shards_of_every_batch_cover_the_epoch_once():
    loader = DeviceLoader(numbered(101), batch_size=16, seed=2)
    per_rank = [torch.cat([shard(idx, rank, 3) for idx in loader.batch_indices()]) for rank in range(3)]
    assert sorted(torch.cat(per_rank).tolist()) == list(range(101))


def test_shard_rejects_bad_ranks():
    indices = torch.arange(8)
    with pytest.raises(ConfigError, match=r"rank must be an int from 0 to 1 \(world_size - 1\), found 2"):
        shard(indices, 2, 2)
    with pytest.raises(ConfigError, match="world_size must be a positive int, found 0"):
        shard(indices, 0, 0)
    with pytest.raises(ConfigError, match=r"indices must be 1-d .* found shape \(2, 4\)"):
        shard(indices.view(2, 4), 0, 2)
