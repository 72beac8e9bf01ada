"""plan's prediction on synthetic inputs whose answers are worked out by hand (pure, like test_buckets.py)."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.tools.plan_model import (
    BucketSpec,
    ComputeProfile,
    Link,
    ScalingRow,
    StepPrediction,
    cpu_share,
    fit_link,
    recommend,
    ring_factor,
    scaling_rows,
    simulate_step,
)

# times in seconds: data 1, forward 2, backward 10, optimizer 1 (14 of compute), bucket copies 0.5. Four
# parameters; the last one's gradient is ready first (1 s into backward), the first one's last (8 s).
PROFILE = ComputeProfile(
    batch=32, data=1, forward=2, backward=10, optimizer=1, grad_ready=(8, 6, 3, 1), bucket_copy=0.5
)
BUCKETS = [BucketSpec((3, 2), 1000), BucketSpec((1, 0), 3000)]  # as our DDP builds them: last layers first


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75)])
def test_ring_factor(n, factor):
    assert ring_factor(n) == pytest.approx(factor)


@pytest.mark.parametrize("nbytes, n, seconds", [(2_000_000, 1, 0.0), (2_000_000, 2, 3e-3), (2_000_000, 4, 4e-3)])
def test_link_cost_is_latency_plus_ring_bytes_over_bandwidth(nbytes, n, seconds):
    assert Link(latency=1e-3, bandwidth=1e9).allreduce_seconds(nbytes, n) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "link, n, sync, starts, ends, exposed, step",
    [
        # bucket 0 (1000 B: 1 + 1 s) ready at max(1, 3) = 3 -> 5; bucket 1 (3000 B: 1 + 3 s) ready at 8 -> 12;
        # backward (10) ends at 12: 2 s exposed; step 14 + 2 + 0.5
        (Link(1, 1000), 2, 0.0, (3, 8), (5, 12), 2, 16.5),
        # the last rank arrives 1 s later at each bucket: everything shifts by 1
        (Link(1, 1000), 2, 1.0, (4, 9), (6, 13), 3, 17.5),
        # four ranks: ring factor 1.5, so 2.5 s and 5.5 s
        (Link(1, 1000), 4, 0.0, (3, 8), (5.5, 13.5), 3.5, 18),
        # latency 5: bucket 0 ends at 9, after bucket 1 is ready (8): bucket 1 waits for the stream, 9 -> 17
        (Link(5, 1000), 2, 0.0, (3, 9), (9, 17), 7, 21.5),
        # a fast link: everything hidden behind backward, only the bucket copies remain
        (Link(0, 1e9), 2, 0.0, (3, 8), (3 + 1e-6, 8 + 3e-6), 0, 14.5),
    ],
)
def test_overlap_of_bucket_all_reduces_with_backward(link, n, sync, starts, ends, exposed, step):
    p = simulate_step(PROFILE, BUCKETS, link, n, sync)
    assert p.bucket_starts == pytest.approx(starts)
    assert p.bucket_ends == pytest.approx(ends)
    assert p.exposed_comm == pytest.approx(exposed)
    assert p.step == pytest.approx(step)
    assert p.comm == pytest.approx(sum(e - s for s, e in zip(starts, ends, strict=True)))


def test_one_device_has_no_communication_and_no_bucket_copies():
    p = simulate_step(PROFILE, BUCKETS, Link(5, 1), 1)
    assert (p.step, p.exposed_comm, p.comm, p.bucket_starts) == (14, 0.0, 0.0, ())


def test_scaled_profile_multiplies_every_time():
    doubled = PROFILE.scaled(2)
    assert (doubled.data, doubled.forward, doubled.backward, doubled.optimizer, doubled.bucket_copy) == (2, 4, 20, 2, 1)
    assert doubled.grad_ready == (16, 12, 6, 2) and doubled.batch == 32


@pytest.mark.parametrize(
    "n, cores, threads, slowdown",
    [(1, 2, 2, 1.0), (2, 2, 1, 1.0), (3, 2, 1, 1.5), (4, 2, 1, 2.0), (3, 16, 5, 1.0), (8, 4, 1, 2.0), (2, 3, 1, 1.0)],
)
def test_cpu_share(n, cores, threads, slowdown):
    assert cpu_share(n, cores) == (threads, pytest.approx(slowdown))


def test_cpu_share_rejects_nonsense():
    with pytest.raises(ConfigError):
        cpu_share(0, 2)


def test_fit_recovers_exact_latency_and_bandwidth():
    link = Link(latency=1e-4, bandwidth=2e9)
    samples = [(n, b, link.allreduce_seconds(b, n)) for n in (2, 3) for b in (4096, 1 << 20, 1 << 24)]
    fitted = fit_link(samples)
    assert fitted.latency == pytest.approx(1e-4, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(2e9, rel=1e-6)


def test_fit_clamps_a_negative_latency():
    fitted = fit_link([(2, 1000, 1e-6), (2, 2000, 3e-6)])  # the line through them crosses 0 at 500 bytes
    assert fitted.latency == 0.0
    assert 5e8 < fitted.bandwidth < 1e9  # through the origin, between the two points' own 1e9 and 6.7e8


@pytest.mark.parametrize(
    "samples, message",
    [([(2, 1000, 1e-3), (2, 1000, 2e-3)], "two sizes"), ([(2, 1000, 2e-3), (2, 2000, 1e-3)], "do not grow")],
)
def test_fit_needs_timings_that_grow_with_size(samples, message):
    with pytest.raises(ConfigError, match=message):
        fit_link(samples)


def _prediction(n: int, step: float) -> StepPrediction:
    return StepPrediction(n, step, step, 0.0, 0.0, (), ())


def test_rows_speedup_efficiency_and_samples_per_second():
    rows = scaling_rows({1: _prediction(1, 10), 2: _prediction(2, 6), 4: _prediction(4, 4)}, 64, {1: 64, 2: 32, 4: 16})
    assert [r.world_size for r in rows] == [1, 2, 4]
    assert [r.speedup for r in rows] == pytest.approx([1, 10 / 6, 2.5])
    assert [r.efficiency for r in rows] == pytest.approx([1, 10 / 12, 0.625])
    assert [r.samples_per_second for r in rows] == pytest.approx([6.4, 64 / 6, 16])
    assert [r.per_device_batch for r in rows] == [64, 32, 16]


def _rows(*speedups: float) -> list[ScalingRow]:
    return [ScalingRow(n, 1, 1.0, 1.0, s, s / n, 0.0, 0.0) for n, s in enumerate(speedups, start=1)]


@pytest.mark.parametrize(
    "speedups, threshold, best",
    [
        ((1, 1.9, 2.6, 3.0), 0.7, 4),  # efficiencies 1, .95, .87, .75
        ((1, 1.9, 2.6, 3.0), 0.8, 3),
        ((1, 1.9, 2.6, 3.0), 0.9, 2),
        ((1, 0.5, 0.6), 0.7, 1),  # two devices are slower than one
        ((1, 1.8, 1.7, 3.9), 0.5, 2),  # the speed-up stops growing at 3: past 2 it does not pay
    ],
)
def test_recommendation_is_the_last_world_size_that_pays(speedups, threshold, best):
    assert recommend(_rows(*speedups), threshold) == best


def test_rows_need_the_one_device_baseline():
    with pytest.raises(ConfigError, match="world size 1"):
        scaling_rows({2: _prediction(2, 1)}, 64, {2: 32})
