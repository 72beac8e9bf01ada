"""What ``paratrain plan`` measures for its model: compute on one device, all-reduces with real processes.

    profiles, moved = measure_profiles(work, device, [(64, 2), (32, 1)], steps=10, warmup=3, rounds=3)
    link = measure_link(2, sizes, {}, timeout=600)              # python -m paratrain.tools.allreduce_probe

What the ranks of a real run share on a CPU (cores, memory bandwidth, caches) and what their meeting costs per
step, plan no longer measures beside stand-in peers: it runs the real strategy (:mod:`paratrain.tools.plan_runs`)
and fits the model to it (:mod:`paratrain.tools.plan_fit`).

Measurements take turns (one step of each shape in rotation) so that a shared machine's changing load does not
favour one of them; every figure is a median. Compute is measured in rounds, and how far a shape's median moved
between rounds says whether the machine held still long enough to measure it.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, assign_buckets
from paratrain.errors import ConfigError
from paratrain.launch.launcher import LaunchConfig, launch
from paratrain.parallel import Parallel
from paratrain.tools.plan_model import ComputeProfile, cpu_share
from paratrain.tools.workload import Workload, build_optimizer

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "ProfileRun",
    "measure_link",
    "measure_profiles",
    "read_link_file",
    "threads_per_process",
]

DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's default bucket_cap_mb


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _Clock:
    """Wall-clock seconds on the CPU; CUDA events on a GPU (gradient hooks run ahead of the kernels there)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


class ProfileRun:
    """The steps ``paratrain train`` runs on one device, at one per-device batch and thread count, timed phase by
    phase: through ``Parallel`` (its loader, weighted backward and step), so that what those cost per step is in
    the prediction as it is in the run a user launches."""

    def __init__(self, work: Workload, device: torch.device, batch: int, threads: int) -> None:
        self.work, self.batch, self.threads = work, batch, threads
        self.par = Parallel("single", [device])
        model = work.build_model()
        optimizer = build_optimizer(work.settings, model.parameters())
        self.model, self.optimizer, self.loader = self.par.prepare(model, optimizer, work.loader(batch))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.batches = iter(self.loader)
        self.clock = _Clock(device)
        self.device = device
        self.ready: list[Any] = [None] * len(self.params)
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.ready.__setitem__(i, self.clock.mark()))
            for i, p in enumerate(self.params)
        ]
        self.phases: dict[str, list[float]] = {"data": [], "forward": [], "backward": [], "optimizer": []}
        self.totals: list[float] = []  # each recorded step, start to end
        self.ready_times: list[list[float]] = [[] for _ in self.params]

    def step(self, record: bool) -> None:
        clock, par = self.clock, self.par
        with _threads(self.threads):
            t0 = clock.mark()
            batch = next(self.batches, None)
            if batch is None:  # the epoch's end: the same batches again (their order does not change the time)
                self.batches = iter(self.loader)
                batch = next(self.batches)
            inputs, targets = batch
            t1 = clock.mark()
            loss = self.work.loss(self.model(inputs), targets)
            t2 = clock.mark()
            par.backward(loss)
            t3 = clock.mark()
            clip = self.work.settings.clip_grad_norm
            if clip is not None:  # as bench and train clip: part of the optimizer phase
                par.clip_grad_norm_(self.model, clip)
            par.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            t4 = clock.mark()
        if not record:
            return
        for name, (a, b) in zip(self.phases, ((t0, t1), (t1, t2), (t2, t3), (t3, t4)), strict=True):
            self.phases[name].append(clock.seconds(a, b))
        self.totals.append(clock.seconds(t0, t4))
        for j, mark in enumerate(self.ready):
            self.ready_times[j].append(clock.seconds(t2, mark) if mark is not None else 0.0)

    def moved(self, rounds: int) -> float:
        """How far the step's median moved between ``rounds`` equal rounds of the recorded steps: the largest
        round's median over the smallest's, minus 1 (0 when there is one round)."""
        size = len(self.totals) // max(rounds, 1)
        medians = [statistics.median(self.totals[i * size : (i + 1) * size]) for i in range(rounds) if size]
        return max(medians) / min(medians) - 1 if len(medians) > 1 and min(medians) > 0 else 0.0

    def profile(self, copy_repeats: int) -> ComputeProfile:
        for h in self.handles:
            h.remove()
        self.par.close()
        med = {name: statistics.median(values) for name, values in self.phases.items()}
        with _threads(self.threads):
            copy = _bucket_copy_seconds(self.params, self.device, copy_repeats)
        return ComputeProfile(
            self.batch,
            med["data"],
            med["forward"],
            med["backward"],
            med["optimizer"],
            tuple(statistics.median(t) for t in self.ready_times),
            copy,
        )


def measure_profiles(
    work: Workload, device: torch.device, shapes: list[tuple[int, int]], steps: int, warmup: int, rounds: int = 1
) -> tuple[dict[tuple[int, int], ComputeProfile], dict[tuple[int, int], float]]:
    """Medians of ``rounds`` x ``steps`` plain training steps for each (per-device batch, threads) in ``shapes``,
    and how far each shape's median moved between the rounds (see :meth:`ProfileRun.moved`).

    The shapes take turns, one step each, the order rotating, so that a shared machine's changing load hits them
    alike (measured one after another, a quiet minute would favour one world size over another).
    """
    runs = [ProfileRun(work, device, batch, threads) for batch, threads in dict.fromkeys(shapes)]
    for i in range(warmup + steps * rounds):
        shift = i % len(runs)
        for run in runs[shift:] + runs[:shift]:
            run.step(record=i >= warmup)
    profiles = {(run.batch, run.threads): run.profile(steps) for run in runs}
    return profiles, {(run.batch, run.threads): run.moved(rounds) for run in runs}


def _bucket_copy_seconds(params: list[torch.nn.Parameter], device: torch.device, repeats: int) -> float:
    """What our reducer adds per step: gradients divided into the bucket buffers, and copied back after."""
    buckets = assign_buckets(params, DDP_BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES)
    buffers = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in buckets]
    grads = [torch.randn_like(p) for p in params]
    pairs = []
    for bucket, buffer in zip(buckets, buffers, strict=True):
        for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
            pairs.append((grads[i], buffer.narrow(0, offset, grads[i].numel()).view_as(grads[i])))
    clock = _Clock(device)
    times = []
    for _ in range(max(3, repeats)):
        start = clock.mark()
        for grad, view in pairs:
            torch.div(grad, 2, out=view)
        for grad, view in pairs:
            grad.copy_(view)
        times.append(clock.seconds(start, clock.mark()))
    return statistics.median(times)


def measure_link(processes: int, sizes: tuple[int, ...], bursts: dict[int, int], timeout: float) -> dict[str, Any]:
    """All-reduce timings, and the synchronisation cost after compute bursts, by real processes on this machine
    (group sizes 2..processes); see :mod:`paratrain.tools.allreduce_probe`."""
    with tempfile.TemporaryDirectory(prefix="paratrain-plan-") as tmp:
        out = Path(tmp) / "link.json"
        args = [str(out)]
        if bursts:
            Path(tmp, "bursts.json").write_text(json.dumps({str(n): units for n, units in bursts.items()}))
            args += ["--bursts", str(Path(tmp, "bursts.json"))]
        code = launch(
            LaunchConfig(nproc_per_node=processes),
            "paratrain.tools.allreduce_probe",
            [*args, *map(str, sizes)],
            module=True,
            timeout=timeout,
        )
        if code != 0 or not out.exists():
            raise ConfigError(
                f"measuring the all-reduce with {processes} processes failed (exit code {code}); give "
                "--link-bandwidth and --link-latency instead"
            )
        measured: dict[str, Any] = json.loads(out.read_text())
        return measured


def read_link_file(path: str) -> list[list[float]]:
    try:
        samples: list[list[float]] = json.loads(Path(path).read_text())["samples"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--link-file {path}: expected the JSON that paratrain.tools.allreduce_probe writes ({exc})"
        ) from exc
    return samples


def threads_per_process(world_size: int, cores: int) -> tuple[int, float]:
    """Threads a ddp worker gets (as paratrain launch gives them: OMP_NUM_THREADS, else cores // N), and the
    time-sharing slowdown."""
    if "OMP_NUM_THREADS" in os.environ:  # launch passes it through to every worker
        try:
            threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            threads = 1
        return threads, max(1.0, world_size * threads / cores)
    return cpu_share(world_size, cores)
