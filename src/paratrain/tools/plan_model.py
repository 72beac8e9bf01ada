"""The prediction behind ``paratrain plan``: a step of ddp at world size N from single-device measurements. Pure.

    link = fit_link([(2, 1 << 20, 0.0012), (2, 8 << 20, 0.0071), (3, 8 << 20, 0.0095)])
    step = simulate_step(profile, buckets, link, world_size=4)
    rows = scaling_rows({1: step1, 2: step2, ...}, global_batch=256)

The step it models is the one our DDP runs (``reducer.py``): gradients become ready during backward at the
times measured on one device; a bucket's all-reduce starts when all of its gradients are ready, buckets start
in index order, and one all-reduce runs at a time (one communication stream); each takes
``latency + 2 (N - 1) / N x bytes / bandwidth`` (a ring all-reduce). The ranks do not reach a bucket together:
``sync`` (measured) is how much later the last rank gets there, so each all-reduce can start that much after
this rank's gradients are ready. Backward ends when both the computation and the last all-reduce have finished.
Around it: data wait, forward, the copies of gradients in and out of the buckets, the optimizer. Processes
that share a machine's CPU cores share its compute: see :func:`cpu_share`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = [
    "BucketSpec",
    "ComputeProfile",
    "Link",
    "ScalingRow",
    "StepPrediction",
    "cpu_share",
    "fit_link",
    "recommend",
    "ring_factor",
    "scaling_rows",
    "simulate_step",
]


@dataclass(frozen=True)
class ComputeProfile:
    """One device's step at one per-device batch, in seconds (medians of measured steps).

    ``grad_ready`` holds, per parameter (in the model's parameter order), when its gradient was accumulated,
    measured from the start of backward.
    """

    batch: int
    data: float
    forward: float
    backward: float
    optimizer: float
    grad_ready: tuple[float, ...]
    bucket_copy: float = 0.0  # copying gradients into the buckets and back (ddp only)

    def scaled(self, factor: float) -> ComputeProfile:
        """Every time multiplied by ``factor`` (compute slowed by sharing cores)."""
        return ComputeProfile(
            self.batch,
            self.data * factor,
            self.forward * factor,
            self.backward * factor,
            self.optimizer * factor,
            tuple(t * factor for t in self.grad_ready),
            self.bucket_copy * factor,
        )


@dataclass(frozen=True)
class BucketSpec:
    """One all-reduce: the parameters whose gradients it carries, and its size."""

    members: tuple[int, ...]
    nbytes: int


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte reduced in a ring all-reduce: 2 (N - 1) / N (0 for one rank)."""
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0


@dataclass(frozen=True)
class Link:
    """The all-reduce cost: ``latency + ring_factor(N) x bytes / bandwidth`` seconds."""

    latency: float  # seconds
    bandwidth: float  # bytes per second

    def allreduce_seconds(self, nbytes: int, world_size: int) -> float:
        if world_size < 2:
            return 0.0
        return self.latency + ring_factor(world_size) * nbytes / self.bandwidth


def fit_link(samples: Sequence[tuple[int, int, float]]) -> Link:
    """Fit latency and bandwidth to ``(world_size, bytes, seconds)`` all-reduce timings.

    Least squares on relative error (weights 1 / seconds^2), so small messages settle the latency and large
    ones the bandwidth. A negative fitted latency (noise) is clamped to 0 and the bandwidth refitted.

    Raises:
        ConfigError: fewer than two distinct sizes, or timings that do not grow with size.
    """
    points = [(ring_factor(n) * b, t, 1.0 / (t * t)) for n, b, t in samples if n > 1 and t > 0]
    if len({x for x, _, _ in points}) < 2:
        raise ConfigError("fitting the all-reduce cost needs timings at two sizes or more")
    sw = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / sw
    mean_t = sum(w * t for _, t, w in points) / sw
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    slope = sum(w * (x - mean_x) * (t - mean_t) for x, t, w in points) / sxx
    latency = mean_t - slope * mean_x
    if latency < 0:
        latency = 0.0
        slope = sum(w * x * t for x, t, w in points) / sum(w * x * x for x, _, w in points)
    if not slope > 0:
        raise ConfigError(
            "the all-reduce timings do not grow with the message size, so no bandwidth can be fitted (a very busy "
            "machine?); run plan again, or give --link-bandwidth and --link-latency"
        )
    return Link(latency, 1.0 / slope)


@dataclass(frozen=True)
class StepPrediction:
    world_size: int
    step: float  # seconds
    compute: float  # the step without communication
    exposed_comm: float  # how much later backward ends because of communication
    comm: float  # total all-reduce time, hidden or not
    bucket_starts: tuple[float, ...]
    bucket_ends: tuple[float, ...]


def simulate_step(
    profile: ComputeProfile, buckets: Sequence[BucketSpec], link: Link, world_size: int, sync: float = 0.0
) -> StepPrediction:
    """The step time of one rank at ``world_size``; one rank (``world_size`` 1) runs without DDP.

    ``sync``: seconds by which the last rank reaches each bucket after this one (0: the ranks keep in step).
    """
    compute = profile.data + profile.forward + profile.backward + profile.optimizer
    if world_size == 1:
        return StepPrediction(1, compute, compute, 0.0, 0.0, (), ())
    starts, ends = [], []
    free = 0.0  # when the communication stream is next free
    for bucket in buckets:
        ready = max((profile.grad_ready[i] for i in bucket.members), default=0.0) + sync
        start = max(ready, free)
        free = start + link.allreduce_seconds(bucket.nbytes, world_size)
        starts.append(start)
        ends.append(free)
    backward_end = max(profile.backward, free)
    step = compute + (backward_end - profile.backward) + profile.bucket_copy
    comm = sum(e - s for s, e in zip(starts, ends, strict=True))
    return StepPrediction(
        world_size,
        step,
        compute + profile.bucket_copy,
        backward_end - profile.backward,
        comm,
        tuple(starts),
        tuple(ends),
    )


def cpu_share(world_size: int, cores: int) -> tuple[int, float]:
    """Threads per process and the slowdown when ``world_size`` processes share ``cores`` CPU cores.

    Each process gets ``max(1, cores // N)`` threads (what ``paratrain launch`` gives each worker); beyond one
    process per core the processes also time-share the cores, so their compute takes ``N x threads / cores``
    times as long as measured alone. The speed of a process at its thread count is measured, not assumed.
    """
    if world_size < 1 or cores < 1:
        raise ConfigError(f"world size and cores must be at least 1; found {world_size} and {cores}")
    threads = max(1, cores // world_size)
    return threads, max(1.0, world_size * threads / cores)


@dataclass(frozen=True)
class ScalingRow:
    world_size: int
    per_device_batch: int
    step_seconds: float
    samples_per_second: float
    speedup: float
    efficiency: float
    exposed_comm_seconds: float
    comm_seconds: float
    source: str = "model"  # "measured" (the real strategy ran here), "extrapolated" (the fitted model), "model"
    fit_error: float | None = None  # at a measured size: the fitted model's error there (None elsewhere)


def scaling_rows(
    steps: Mapping[int, StepPrediction], global_batch: int, per_device: Mapping[int, int]
) -> list[ScalingRow]:
    """One row per world size: samples/s of the global batch, speed-up and efficiency against world size 1."""
    if 1 not in steps:
        raise ConfigError("scaling rows need the prediction for world size 1 (the baseline)")
    base = steps[1].step
    rows = []
    for n in sorted(steps):
        p = steps[n]
        speedup = base / p.step
        rows.append(
            ScalingRow(n, per_device[n], p.step, global_batch / p.step, speedup, speedup / n, p.exposed_comm, p.comm)
        )
    return rows


def recommend(rows: Sequence[ScalingRow], min_efficiency: float) -> int:
    """The world size past which adding devices stops paying: the last one before efficiency first drops below
    ``min_efficiency`` (or before the speed-up stops growing); 1 when even two devices do not pay."""
    best = 1
    previous_speedup = 1.0
    for row in sorted(rows, key=lambda r: r.world_size):
        if row.world_size == 1:
            continue
        if row.efficiency < min_efficiency or row.speedup <= previous_speedup or math.isnan(row.efficiency):
            break
        best, previous_speedup = row.world_size, row.speedup
    return best
