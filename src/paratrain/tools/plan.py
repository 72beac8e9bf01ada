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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..buckets import FIRST_BUCKET_BYTES, assign_buckets
from ..devices import visible_gpus
from ..errors import ConfigError
from ..settings import at_least, optional, positive, setting
from .configs import parse_configs
from .plan_measure import (
    DDP_BUCKET_CAP_BYTES,
    bursts_for,
    contention,
    measure_link,
    measure_profiles,
    read_link_file,
    threads_per_process,
)
from .plan_memory import MemoryRow, check_bytes, measure_memory, parse_bytes, render_memory, smallest_fit
from .plan_model import (
    BucketSpec,
    Link,
    ScalingRow,
    fit_link,
    recommend,
    scaling_rows,
    simulate_step,
)
from .plan_validate import VALIDATE_UP_TO, validate_plan, validation_configs
from .report import format_table, write_json
from .settings import RunSettings, TimingSettings, settings_from
from .workload import Workload

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


# -- the report ----------------------------------------------------------------------------------------------------


@dataclass
class PlanReport:
    settings: dict[str, Any]
    rows: list[ScalingRow]
    recommended: int
    assumptions: list[str]
    inputs: dict[str, Any]
    validation: list[dict[str, Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # the files written (the JSON report)
    memory: list[MemoryRow] = field(default_factory=list)  # bytes per device of ddp, zero1 and zero2 at each N

    @property
    def ok(self) -> bool:
        """False when a validated configuration's prediction error exceeds ``max_error``."""
        return all(v["within"] for v in self.validation if v.get("within") is not None)

    def row(self, world_size: int) -> ScalingRow:
        return next(r for r in self.rows if r.world_size == world_size)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": "plan",
            "ok": self.ok,
            "settings": self.settings,
            "rows": [asdict(r) for r in self.rows],
            "recommended_world_size": self.recommended,
            "assumptions": self.assumptions,
            "inputs": self.inputs,
            "validation": self.validation,
            "memory": [{**asdict(r), "model_states": r.model_states, "total": r.total} for r in self.memory],
            "fewest_devices": self.fewest_devices(),
        }

    def fewest_devices(self) -> dict[str, int | None] | None:
        """With --device-memory: the fewest devices ddp, zero1 and zero2 fit on (None: not up to max-world-size)."""
        limit = self.settings.get("device_memory")
        return smallest_fit(self.memory, parse_bytes(limit)) if limit and self.memory else None

    def render(self) -> str:
        headers = ["world size", "batch/device", "step ms", "samples/s", "speed-up", "efficiency", "exposed comm ms"]
        table = [
            [
                str(r.world_size),
                str(r.per_device_batch),
                f"{r.step_seconds * 1e3:.2f}",
                f"{r.samples_per_second:,.0f}",
                f"{r.speedup:.2f}x",
                f"{r.efficiency:.0%}",
                f"{r.exposed_comm_seconds * 1e3:.2f}",
            ]
            for r in self.rows
        ]
        lines = [format_table(headers, table), "", "assumptions:"]
        lines += [f"  - {a}" for a in self.assumptions]
        if self.memory:
            limit = self.settings.get("device_memory")
            lines += ["", *render_memory(self.memory, parse_bytes(limit) if limit else None)]
            lines.append("  step times above are ddp's; zero1 and zero2 run within a few percent of it on this machine")
        lines.append("")
        lines.append(self.verdict())
        if self.validation:
            lines += ["", "validation against bench (measured here, now):"]
            vt = [
                [
                    v["config"],
                    f"{v['predicted_seconds'] * 1e3:.2f}" if v.get("predicted_seconds") else "-",
                    f"{v['measured_seconds'] * 1e3:.2f}" if v.get("measured_seconds") else "-",
                    f"{v['error']:+.1%}" if v.get("error") is not None else v.get("status", ""),
                ]
                for v in self.validation
            ]
            lines.append(format_table(["configuration", "predicted ms", "measured ms", "error"], vt))
            lines.append(f"  error = predicted / measured - 1; passes within +-{self.settings['max_error']:.0%}")
        return "\n".join(lines)

    def verdict(self) -> str:
        slower = [r for r in self.rows if r.world_size > 1 and r.speedup < 1]
        n = self.recommended
        threshold = self.settings["min_efficiency"]
        if n == 1:
            two = next((r for r in self.rows if r.world_size == 2), None)
            detail = f" (2 devices: {two.speedup:.2f}x, efficiency {two.efficiency:.0%})" if two else ""
            head = f"recommendation: stay on 1 device: more devices do not pay off{detail}"
        else:
            r = self.row(n)
            head = (
                f"recommendation: up to {n} devices ({r.speedup:.2f}x, efficiency {r.efficiency:.0%}); past that, "
                f"efficiency falls below {threshold:.0%} or the speed-up stops growing"
            )
        if slower:
            listed = ", ".join(str(r.world_size) for r in slower)
            head += f"\nwarning: with {listed} devices a step is predicted SLOWER than on one device"
        return head


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
    for n in range(1, config.max_world_size + 1):
        batch = math.ceil(config.batch_size / n)  # the largest share sets the pace
        if gpus or n == 1:  # one GPU per process; single runs in this process with its threads
            threads, slowdown = torch.get_num_threads(), 1.0
        else:
            threads, slowdown = threads_per_process(min(n, per_node), cores)
        shapes[n] = (batch, threads, slowdown)
    profiles = measure_profiles(work, device, [(b, t) for b, t, _ in shapes.values()], config.steps, config.warmup)
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
    recommended = recommend(rows, config.min_efficiency)

    assumptions = _assumptions(
        config, str(device), cores, param_count, buckets, inputs_rows, local_links, sync, remote_link, per_node
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
    }
    report = PlanReport(asdict(config), rows, recommended, assumptions, inputs)
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


def _assumptions(
    config: PlanConfig,
    device: str,
    cores: int,
    param_count: int,
    buckets: list[BucketSpec],
    inputs_rows: list[dict[str, Any]],
    local_links: dict[int, Link],
    sync: dict[int, float],
    remote_link: Link | None,
    per_node: int,
) -> list[str]:
    """What the prediction takes as given, in words, for the printed report."""
    gpus = device.startswith("cuda")
    local_max = min(config.max_world_size, per_node)
    assumptions: list[str] = []
    assumptions.append(
        f"model {config.model}: {param_count:,} parameters ({param_count * 4 / 2**20:.1f} MiB of float32 gradients), "
        f"{len(buckets)} bucket(s) as our DDP builds them (first {FIRST_BUCKET_BYTES // 2**20} MiB, then "
        f"{DDP_BUCKET_CAP_BYTES // 2**20} MiB): {', '.join(f'{b.nbytes / 2**20:.2f}' for b in buckets)} MiB"
    )
    assumptions.append(
        f"global batch {config.batch_size} split N ways; each device runs the largest share, ceil(batch / N); "
        f"compute measured on {device} in this process, medians of {config.steps} steps"
    )
    if not gpus:
        thread_text = ", ".join(f"N={r['world_size']}: {r['threads_per_process']}" for r in inputs_rows)
        contention_text = ", ".join(f"N={r['world_size']}: x{r['cpu_contention']:.2f}" for r in inputs_rows)
        assumptions.append(
            f"CPU: the N processes share this machine's {cores} cores; compute measured at the threads each process "
            f"gets ({thread_text}), slowed by N x threads / cores beyond one process per core, and by what running "
            f"beside its peers costs, measured with real processes running the model ({contention_text})"
        )
    for n, link in local_links.items():
        assumptions.append(
            f"all-reduce among {n} processes here ({'nccl' if gpus else 'gloo'}, measured): "
            f"{link.latency * 1e6:.0f} us + 2(N-1)/N x bytes / {link.bandwidth / 1e9:.2f} GB/s; the ranks meet "
            f"{sync.get(n, 0.0) * 1e3:.2f} ms late per step (measured: steps of the model's compute length, with "
            "and without a tiny all-reduce)"
        )
    if local_links and max(local_links) < local_max:
        assumptions.append(
            f"world sizes {max(local_links) + 1}..{local_max} on this machine: extrapolated from "
            f"{max(local_links)} processes"
        )
    if remote_link is not None:
        assumptions.append(
            f"world sizes above {per_node} span machines: ring all-reduce over the link, "
            f"{remote_link.latency * 1e6:.0f} us + 2(N-1)/N x bytes / {remote_link.bandwidth / 1e9:.2f} GB/s"
        )
    assumptions.append(
        "overlap as our reducer runs it: a bucket's all-reduce starts when its gradients are ready, in bucket "
        "order, one at a time; backward ends when the last one finishes; ddp only (dp is not modelled)"
    )
    return assumptions


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
