from __future__ import annotations

import random

import pytest
import torch

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, assign_buckets
from paratrain.errors import ConfigError

MB = 1024 * 1024


def _params(*specs):
    """specs: (numel, dtype) in registration order."""
    return [torch.empty(n, dtype=dtype) for n, dtype in specs]


def _table(buckets):
    return [(b.indices, b.numel, b.dtype) for b in buckets]


def test_reverse_order_first_bucket_small_then_up_to_the_cap():
    # 6 float32 tensors of 0.5 MB each; cap 1.5 MB: first bucket 1 MB (2 tensors), then 1.5 MB (3), then the rest
    half = MB // 8  # numel of 0.5 MB of float32
    buckets = assign_buckets(_params(*[(half, torch.float32)] * 6), cap_bytes=3 * MB // 2)
    assert [b.indices for b in buckets] == [(5, 4), (3, 2, 1), (0,)]
    assert [b.nbytes for b in buckets] == [MB, 3 * MB // 2, MB // 2]
    assert buckets[0].nbytes <= FIRST_BUCKET_BYTES
    assert [b.offsets for b in buckets] == [(0, half), (0, half, 2 * half), (0,)]


def test_a_bucket_closes_once_it_reaches_the_cap_so_it_may_pass_it_by_its_last_tensor():
    params = _params((10, torch.float32), (300_000, torch.float32), (20, torch.float32), (100, torch.float32))
    buckets = assign_buckets(params, cap_bytes=MB)  # the 300k tensor is 1.2 MB on its own
    assert _table(buckets) == [((3, 2, 1), 300_120, torch.float32), ((0,), 10, torch.float32)]


@pytest.mark.parametrize("seed", range(200))
def test_the_buckets_are_torchs(seed):
    """torch's DDP rebuilds its buckets after the first step with this function, over the parameters in the order
    their gradients became ready (reverse registration, for a model used in the order it was defined): ours put
    the same parameters together. Only the launch order of the last, unfilled buckets of several dtypes may
    differ (torch's follows its map of dtypes)."""
    import torch.distributed as dist

    rnd = random.Random(seed)
    sizes = [1, 10, 1000, 70_000, 300_000, 1_000_000]
    params = [
        torch.empty(rnd.choice(sizes), dtype=rnd.choice([torch.float32, torch.float32, torch.float16]))
        for _ in range(rnd.randint(1, 12))
    ]
    cap = rnd.choice([MB // 2, MB, 5 * MB // 2, 25 * MB])
    reverse = list(range(len(params)))[::-1]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        params[::-1], [min(FIRST_BUCKET_BYTES, cap), cap], [False] * len(params), reverse
    )
    ours = [list(b.indices) for b in assign_buckets(params, cap)]
    if len({p.dtype for p in params}) == 1:
        assert ours == theirs
    else:
        assert sorted(ours) == sorted(theirs)


def test_one_dtype_per_bucket():
    params = _params((4, torch.float32), (4, torch.float16), (4, torch.float32), (4, torch.float16))
    buckets = assign_buckets(params, cap_bytes=MB)
    assert {b.dtype for b in buckets} == {torch.float32, torch.float16}
    for b in buckets:
        assert all(params[i].dtype == b.dtype for i in b.indices)
    assert sorted(i for b in buckets for i in b.indices) == [0, 1, 2, 3]


def test_each_dtype_gets_its_own_small_first_bucket():
    quarter = MB // 16  # 0.25 MB of float32, 0.125 MB of float16
    params = _params(*[(quarter, torch.float32)] * 6, *[(quarter * 4, torch.float16)] * 3)
    buckets = assign_buckets(params, cap_bytes=25 * MB)
    f16 = [b for b in buckets if b.dtype == torch.float16]
    f32 = [b for b in buckets if b.dtype == torch.float32]
    assert f16[0].nbytes == MB // 2 * 2 and f16[0].indices == (8, 7)  # first bucket of the dtype closes at 1 MB
    assert f32[0].indices == (5, 4, 3, 2)  # 4 x 0.25 MB = the 1 MB first bucket


def test_defaults_match_25_mb_buckets_for_a_10m_parameter_mlp():
    shapes = [(2048 * 784,), (2048,), (2048 * 2048,), (2048,), (2048 * 2048,), (2048,), (10 * 2048,), (10,)]
    params = [torch.empty(s) for s in shapes]
    buckets = assign_buckets(params, cap_bytes=25 * MB)
    # last layer first (its gradient is ready first), with the next layer's weight that fills the 1 MB first bucket
    assert [b.indices for b in buckets] == [(7, 6, 5, 4), (3, 2, 1, 0)]
    assert sum(b.numel for b in buckets) == sum(p.numel() for p in params)


def test_bad_cap():
    with pytest.raises(ConfigError, match="bucket_cap_mb must be positive"):
        assign_buckets(_params((1, torch.float32)), cap_bytes=0)
