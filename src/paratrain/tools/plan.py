"""``paratrain plan``: how fast will ddp be on N devices, and will the model fit (ddp, zero1, zero2), before renting?

    paratrain plan                                        # SimpleNet, world sizes 1..8, on this machine
    paratrain plan --model mlp --width 2048 --max-world-size 4 --validate
    paratrain plan --per-node 8 --max-world-size 32 --link-bandwidth 12.5 --link-latency 2e-5   # 4 machines
    paratrain plan --model mlp --width 8192 --optimizer adamw --device-memory 80GB   # will it fit, and on how many

Everything it needs is measured here, on one device, in seconds: forward, backward and optimizer time at the
per-device batch each N implies (the global ``--batch-size`` split N ways), when each gradient becomes ready
during backward, and the copy of gradients into buckets and back; the buckets our DDP would build; the
all-reduce cost (latency + bytes / bandwidth) timed with real processes on this machine, or given for links it
cannot measure. On the CPU, N processes share the machine's cores, so compute is measured at the thread count
each process would get, and again beside N - 1 real processes running the same steps (they share memory
bandwidth and caches too: :mod:`paratrain.tools.busy`). :mod:`paratrain.tools.plan_model` turns those into a
step time per N.
``--validate`` runs ``bench`` for what this machine can run and prints the prediction error of each.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, assign_buckets
from paratrain.devices import visible_gpus
from paratrain.errors import ConfigError
from paratrain.settings import at_least, optional, positive, setting
from paratrain.tools.configs import parse_configs
from paratrain.tools.plan_measure import (
    DDP_BUCKET_CAP_BYTES,
    bursts_for,
    contention,
    measure_link,
    measure_profiles,
    read_link_file,
    threads_per_process,
)
from paratrain.tools.plan_memory import check_bytes, measure_memory
from paratrain.tools.plan_model import (
    BucketSpec,
    Link,
    fit_link,
    recommend,
    scaling_rows,
    simulate_step,
)
from paratrain.tools.plan_report import PlanReport, describe_assumptions, unreliable_reasons
from paratrain.tools.plan_validate import VALIDATE_UP_TO, validate_plan, validation_configs
from paratrain.tools.report import write_json
from paratrain.tools.settings import RunSettings, TimingSettings, settings_from
from paratrain.tools.workload import Workload
from paratrain.training.threads import MachineLoad, choose_threads

__all__ = ["PlanConfig", "PlanReport", "plan"]


@dataclass
class PlanConfig(TimingSettings, RunSettings):
    """Settings of ``paratrain plan``."""

    max_world_size: int = setting(8, "predict world sizes 1..N", check=at_least(1))
    min_efficiency: float = setting(
        0.7,
        "recommend the world size past which efficiency falls below this",
        check=lambda v: None if 0 < v <= 1 else "in (0, 1]",
    )
    per_node: int | None = setting(
        None,
        "devices (processes) per machine; larger world sizes span machines over the link (default: this "
        "machine's GPUs, or every world size on one machine on the CPU)",
        check=optional(at_least(1)),
        metavar="N",
    )
    link_bandwidth: float | None = setting(
        None,
        "bandwidth between machines in GB/s, for world sizes above --per-node",
        check=optional(positive("GB/s")),
        metavar="GB/S",
    )
    link_latency: float | None = setting(
        None,
        "latency of an all-reduce between machines, seconds",
        check=optional(at_least(0)),
        metavar="SECONDS",
    )
    link_file: str | None = setting(
        None,
        "all-reduce timings across machines written by `paratrain launch ... -m paratrain.tools.allreduce_probe "
        "FILE`, instead of --link-bandwidth/--link-latency",
        metavar="FILE.json",
    )
    device_memory: str | None = setting(
        None,
        "memory of each device (80GB, 24GiB): plan says the fewest devices ddp, zero1 and zero2 fit the model on",
        check=check_bytes,
        metavar="SIZE",
    )
    validate: bool = setting(False, "also run bench on what this machine can run and print the prediction error")
    max_error: float = setting(
        0.15, "--validate: the largest prediction error that passes (0.15 = 15%)", check=positive()
    )

    def check_group(self) -> None:
        if self.precision != "32" or self.accumulate != 1:
            raise ConfigError(
                f"plan models float32 steps of one micro-batch; found --precision {self.precision} --accumulate "
                f"{self.accumulate}. Drop those two flags for plan (bench and verify take them)"
            )
        given = [self.link_bandwidth is not None, self.link_latency is not None]
        if any(given) and not all(given):
            raise ConfigError("--link-bandwidth and --link-latency go together: give both (or --link-file)")
        if all(given) and self.link_file is not None:
            raise ConfigError("give either --link-bandwidth/--link-latency or --link-file, not both")
        for config in parse_configs(self.configs) if self.configs is not None else []:
            if config.strategy == "dp":
                raise ConfigError(
                    f"plan predicts ddp (one process per device); {config.word} is dp: validate with single and "
                    "ddp:N configurations"
                )


def plan(config: PlanConfig | None = None, /, **settings: Any) -> PlanReport:
    """Predict ddp's step time at world sizes 1..max_world_size; see the module docstring.

    Raises:
        ConfigError: settings no run can use, or links it can neither measure nor was given.
    """
    config = settings_from(PlanConfig, config, settings)
    gpus = visible_gpus()
    device = gpus[0] if gpus else torch.device("cpu")
    cores = os.cpu_count() or 1
    per_node = config.per_node or (len(gpus) if gpus else config.max_world_size)
    local_max = min(config.max_world_size, per_node)
    remote = config.max_world_size > per_node
    remote_link = _remote_link(config) if remote else None
    if remote and remote_link is None:
        raise ConfigError(
            f"world sizes above {per_node} (--per-node) span several machines: give the link between them with "
            "--link-bandwidth GB/S and --link-latency SECONDS, or measure it with `paratrain launch --nnodes ... "
            "-m paratrain.tools.allreduce_probe FILE` and pass --link-file FILE"
        )
    work = Workload.load(config)
    model = work.build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    param_count = sum(p.numel() for p in params)
    buckets = [
        BucketSpec(b.indices, b.nbytes) for b in assign_buckets(params, DDP_BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES)
    ]

    # compute at the per-device batch (and, on the CPU, thread count) of every world size
    shapes: dict[int, tuple[int, int, float]] = {}  # world size -> (batch, threads, slowdown)
    load_before = MachineLoad.now()
    for n in range(1, config.max_world_size + 1):
        batch = math.ceil(config.batch_size / n)  # the largest share sets the pace
        if gpus:  # one GPU per process: the host threads do not set the pace
            threads, slowdown = torch.get_num_threads(), 1.0
        elif n == 1:  # what `paratrain train` gives one device: OMP_NUM_THREADS, else every core
            threads, slowdown = choose_threads("single", [device], launched=False), 1.0
        else:  # what `paratrain launch` gives each of N workers: OMP_NUM_THREADS, else cores // N
            threads, slowdown = threads_per_process(min(n, per_node), cores)
        shapes[n] = (batch, threads, slowdown)
    profiles, moved = measure_profiles(
        work, device, [(b, t) for b, t, _ in shapes.values()], config.steps, config.warmup, config.repeats
    )
    # on the CPU, beside the other processes of the same world size: they share memory bandwidth and caches too
    shared = {} if gpus else contention(work, shapes, per_node, cores, config.steps, config.warmup)

    # the all-reduce inside this machine, and what the ranks' meeting costs per step, with real processes
    local_links: dict[int, Link] = {}
    sync: dict[int, float] = {}
    link_samples: list[list[float]] = []
    if local_max >= 2:
        if gpus and len(gpus) < 2:
            if remote_link is None:
                raise ConfigError(
                    "this machine has one GPU, so the all-reduce between GPUs cannot be measured here; give "
                    "--link-bandwidth and --link-latency of the GPUs you plan to use"
                )
            local_links = {n: remote_link for n in range(2, local_max + 1)}
        else:
            probe = min(local_max, len(gpus) if gpus else VALIDATE_UP_TO)
            bursts = {} if gpus else bursts_for(profiles, shapes, probe)
            measured = measure_link(probe, _probe_sizes(buckets), bursts, config.run_timeout)
            link_samples = measured["samples"]
            for n in range(2, probe + 1):
                local_links[n] = fit_link([(int(m), int(b), float(t)) for m, b, t in link_samples if int(m) == n])
                sync[n] = float(measured.get("sync", {}).get(str(n), 0.0))

    steps = {}
    per_device = {}
    inputs_rows = []
    for n, (batch, threads, slowdown) in shapes.items():
        per_device[n] = batch
        factor = slowdown * shared.get(n, 1.0)
        profile = profiles[batch, threads].scaled(factor) if factor != 1.0 else profiles[batch, threads]
        measured_n = max((m for m in local_links if m <= n), default=None)  # beyond the probe: its largest size
        if n > per_node:
            link, n_sync = remote_link, 0.0
        elif measured_n is not None:
            link, n_sync = local_links[measured_n], sync.get(measured_n, 0.0)
        else:
            link, n_sync = None, 0.0
        steps[n] = simulate_step(profile, buckets, link or Link(0.0, 1.0), n, n_sync)
        inputs_rows.append(
            {
                "world_size": n,
                "per_device_batch": batch,
                "threads_per_process": threads,
                "cpu_slowdown": slowdown,
                "cpu_contention": shared.get(n, 1.0),
                "data_seconds": profile.data,
                "forward_seconds": profile.forward,
                "backward_seconds": profile.backward,
                "optimizer_seconds": profile.optimizer,
                "bucket_copy_seconds": profile.bucket_copy if n > 1 else 0.0,
                "last_grad_ready_seconds": max(profile.grad_ready, default=0.0),
                "sync_seconds": n_sync,
                "link": None if link is None or n == 1 else asdict(link),
                "link_from": "between machines" if n > per_node else f"measured with {measured_n} processes",
            }
        )
    rows = scaling_rows(steps, config.batch_size, per_device)
    load = MachineLoad.busiest(load_before, MachineLoad.now())
    unreliable = unreliable_reasons(rows, moved)
    recommended = None if unreliable else recommend(rows, config.min_efficiency)

    assumptions = describe_assumptions(
        config,
        config.repeats,
        config.max_world_size,
        str(device),
        cores,
        param_count,
        buckets,
        inputs_rows,
        local_links,
        sync,
        remote_link,
        per_node,
    )
    inputs = {
        "device": str(device),
        "cores": cores,
        "parameters": param_count,
        "buckets_bytes": [b.nbytes for b in buckets],
        "link_samples": link_samples,
        "local_links": {str(n): asdict(link) for n, link in local_links.items()},
        "sync_seconds": {str(n): v for n, v in sync.items()},
        "remote_link": asdict(remote_link) if remote_link else None,
        "per_node": per_node,
        "per_world_size": inputs_rows,
        "moved_between_repeats": {f"batch {b}, {t} threads": m for (b, t), m in moved.items()},
        "load_average": load.load_average,
    }
    report = PlanReport(asdict(config), rows, recommended, assumptions, inputs, unreliable=unreliable)
    sample = work.sample_batch(1)[0].to(device)
    report.memory = measure_memory(model.to(device), sample, config.optimizer, config.momentum, per_device)
    if config.validate:
        report.validation = validate_plan(
            config,
            validation_configs(config.configs, config.max_world_size),
            {row.world_size: row.step_seconds for row in report.rows},
            config.max_error,
        )
    if config.report_out:
        write_json(report.as_dict(), config.report_out)
        report.written.append(config.report_out)
    return report


def _probe_sizes(buckets: list[BucketSpec]) -> tuple[int, ...]:
    """Message sizes to time: small ones for the latency, and the model's own bucket sizes."""
    sizes = {1 << 12, 1 << 16, 1 << 20, 1 << 23, 1 << 24, *(b.nbytes for b in buckets)}
    return tuple(sorted(s - s % 4 for s in sizes if s >= 4))


def _remote_link(config: PlanConfig) -> Link | None:
    if config.link_file is not None:
        return fit_link([(int(n), int(b), float(t)) for n, b, t in read_link_file(config.link_file)])
    if config.link_bandwidth is not None and config.link_latency is not None:
        return Link(config.link_latency, config.link_bandwidth * 1e9)
    return None
