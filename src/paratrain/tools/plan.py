"""``paratrain plan``: how fast will ddp be on N devices, and will the model fit (ddp, zero1, zero2), before renting?

    paratrain plan                                        # SimpleNet, world sizes 1..8, on this machine
    paratrain plan --model mlp --width 2048 --max-world-size 4 --validate
    paratrain plan --per-node 8 --max-world-size 32 --link-bandwidth 12.5 --link-latency 2e-5   # 4 machines
    paratrain plan --model mlp --width 8192 --optimizer adamw --device-memory 80GB   # will it fit, and on how many

At the world sizes this machine can run (its GPUs, one per process, or up to its cores on the CPU, or
``--measure-up-to``), plan runs the user's job for real, as ``paratrain train`` would run it
(:mod:`paratrain.tools.plan_runs`: single in this process, ``ddp:N`` in one launch of N workers, each at train's
threads, timed in rounds after the warm-up until two rounds agree; the largest size's workers then time the
all-reduce the model needs): those rows are "measured", and the measurement is the answer. Beyond them the step
is the model's (:mod:`paratrain.tools.plan_model`: compute measured on one device at the per-device batch each N
implies, when each gradient becomes ready, the buckets our DDP would build, the all-reduce timed between real
processes, or given for links it cannot measure), fitted to the measured runs (:mod:`paratrain.tools.plan_fit`):
those rows are "extrapolated", and the table gives the fit's error at the measured sizes, with the model's error
before the fit. ``--budget`` bounds the measured steps' time (a round of tiny steps still lasts about a second);
the report says when a longer one would change the answer. Each phase prints a line on stderr (``--quiet``:
none).
``--validate`` also runs ``bench`` for what this machine can run and prints the prediction error of each.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, assign_buckets
from paratrain.devices import visible_gpus
from paratrain.errors import ConfigError
from paratrain.settings import at_least, optional, positive, setting
from paratrain.tools.configs import parse_configs
from paratrain.tools.plan_fit import CommFit, MeasuredPoint, compute_factor, fit_errors, fit_overhead
from paratrain.tools.plan_measure import (
    DDP_BUCKET_CAP_BYTES,
    measure_link,
    measure_profiles,
    read_link_file,
    threads_per_process,
)
from paratrain.tools.plan_memory import check_bytes, measure_memory
from paratrain.tools.plan_model import (
    BucketSpec,
    Link,
    StepPrediction,
    fit_link,
    recommend,
    scaling_rows,
    simulate_step,
)
from paratrain.tools.plan_progress import PhaseProgress
from paratrain.tools.plan_report import PlanReport, describe_assumptions, unreliable_reasons
from paratrain.tools.plan_runs import budget_notes, measured_sizes, run_real, run_words
from paratrain.tools.plan_validate import validate_plan, validation_configs
from paratrain.tools.report import write_json
from paratrain.tools.settings import RunSettings, TimingSettings, settings_from
from paratrain.tools.workload import Workload
from paratrain.training.threads import MachineLoad, choose_threads

__all__ = ["PlanConfig", "PlanReport", "plan"]

RUN_SHARE = 0.7  # of --budget: the real runs' timed steps; the rest for the one-device profiles of the model
PROFILE_ROUNDS = 2  # rounds of the profiles (their medians must agree); the fit to the real runs absorbs the rest


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
    budget: float = setting(
        30.0,
        "seconds plan aims to spend in timed steps, all its runs together: a slow model takes fewer than --steps "
        "(at least 3 a run), and the report says when a longer budget would change the answer",
        check=positive("seconds"),
        metavar="SECONDS",
    )
    measure_up_to: int | None = setting(
        None,
        "run the real strategy at world sizes up to N here (default: this machine's GPUs, or its cores on the "
        "CPU); larger ones are extrapolated from the model fitted to those runs",
        check=optional(at_least(1)),
        metavar="N",
    )
    quiet: bool = setting(False, "no progress: no progress bar, no per-step lines, no per-phase lines (plan)")

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
        ConfigError: settings no run can use, a measured run that failed, or links it can neither measure nor
            was given.
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
    sizes = measured_sizes(config.max_world_size, per_node, len(gpus), cores, config.measure_up_to)
    gpus_short = bool(gpus) and len(gpus) < 2  # one GPU: no all-reduce between GPUs to time here
    beyond = [n for n in range(1, config.max_world_size + 1) if n not in sizes]
    words = run_words(sizes)
    probes = bool(beyond) and not gpus_short  # the largest size's processes time the all-reduce too
    running = {w: _running(w, config.repeats, probes and w == words[-1] and w != "single") for w in words}
    progress = PhaseProgress(list(running.values()), enabled=not config.quiet)
    if beyond:
        progress.add(f"measuring compute on one device for world sizes {_span(beyond)}")
    progress.add("measuring memory")
    if config.validate:
        progress.add("validating against bench")
    load_before = MachineLoad.now()

    # the world sizes this machine can run: the real strategy, the user's job, timed over steady-state steps; the
    # largest ddp size's processes also time the all-reduce when the model extrapolates (no launch of their own)
    share = config.budget * (RUN_SHARE if beyond else 1.0) / max(1, len(words) * config.repeats)
    timings, link_samples = run_real(
        config,
        sizes,
        share,
        on_run=lambda run: progress.start(running[run.word]),
        link_sizes=_probe_sizes(buckets) if probes else (),
    )
    failed = [t for t in timings if t.status != "OK"]
    if failed:
        raise ConfigError(
            f"plan runs the real strategy at the world sizes this machine can run; {failed[0].config} did not run "
            f"({failed[0].status}: {failed[0].reason}). Try --measure-up-to {max(1, failed[0].devices - 1)}"
        )
    measured = {t.devices: t for t in timings}

    # beyond them: the model (compute on one device, the all-reduce between processes), fitted to those runs
    model_steps: dict[int, StepPrediction] = {}
    raw_steps: dict[int, StepPrediction] = {}
    factors: dict[int, float] = {}
    moved: dict[tuple[int, int], float] = {}
    local_link: Link | None = None
    fit = CommFit()
    points: list[MeasuredPoint] = []
    raw_errors: dict[int, float] = {}
    if beyond:
        calibrate = [n for n in sizes if n > 1] or [1]
        shapes = {n: _shape(n, config.batch_size, gpus, device, per_node, cores) for n in (*calibrate, *beyond)}
        estimate = measured[max(calibrate)].step_seconds
        progress.start(f"measuring compute on one device for world sizes {_span(beyond)}")
        rounds = min(config.repeats, PROFILE_ROUNDS)
        steps = _profile_steps(config, estimate, len(shapes) * rounds, config.budget * (1 - RUN_SHARE))
        profiles, moved = measure_profiles(
            work, device, [(b, t) for b, t, _ in shapes.values()], steps, min(config.warmup, 1), rounds
        )
        probe = max(calibrate) if max(calibrate) > 1 else min(2, local_max)
        if probe >= 2 and not gpus_short:
            if not link_samples:  # no ddp size was measured here: a launch of its own
                progress.start("measuring the all-reduce between processes")
                link_samples = measure_link(probe, _probe_sizes(buckets), {}, config.run_timeout)["samples"]
            local_link = fit_link([(int(m), int(b), float(t)) for m, b, t in link_samples if int(m) == probe])
        elif gpus_short and local_max >= 2:
            if remote_link is None:
                raise ConfigError(
                    "this machine has one GPU, so the all-reduce between GPUs cannot be measured here; give "
                    "--link-bandwidth and --link-latency of the GPUs you plan to use"
                )
            local_link = remote_link
        for n, (batch, threads, slowdown) in shapes.items():
            link = remote_link if n > per_node else local_link
            profile = profiles[batch, threads].scaled(slowdown)
            raw_steps[n] = simulate_step(profile, buckets, link or Link(0.0, 1.0), n)
            if n in measured:
                timing = measured[n]
                seen = timing.phase_seconds["forward"] + timing.phase_seconds["optimizer"]
                factors[n] = compute_factor(seen, profile.forward + profile.optimizer)
        for n, (batch, threads, slowdown) in shapes.items():
            link = remote_link if n > per_node else local_link
            factor = factors.get(n, factors[max(calibrate)])
            profile = profiles[batch, threads].scaled(slowdown * factor)
            model_steps[n] = simulate_step(profile, buckets, link or Link(0.0, 1.0), n)
        points = [MeasuredPoint(n, model_steps[n].step, measured[n].step_seconds) for n in calibrate if n > 1]
        fit = fit_overhead(points)
        # what the model alone (neither compute scaled nor overhead fitted) says at the measured sizes
        raw_errors = {n: raw_steps[n].step / measured[n].step_seconds - 1 for n in calibrate if n > 1}
    errors = fit_errors(fit, points)

    steps_by_n: dict[int, StepPrediction] = {}
    sources: dict[int, str] = {}
    for n in range(1, config.max_world_size + 1):
        if n in measured:
            step = measured[n].step_seconds
            compute = model_steps[n].compute if n in model_steps else step
            beyond_compute = max(0.0, step - compute) if n > 1 and n in model_steps else 0.0
            steps_by_n[n] = StepPrediction(n, step, compute, beyond_compute, beyond_compute, (), ())
            sources[n] = "measured"
        else:
            p = model_steps[n]
            extra = fit.extra(n)
            steps_by_n[n] = StepPrediction(
                n, p.step + extra, p.compute, p.exposed_comm + extra, p.comm, p.bucket_starts, p.bucket_ends
            )
            sources[n] = "extrapolated"
    per_device = {n: math.ceil(config.batch_size / n) for n in steps_by_n}
    rows = [
        replace(row, source=sources[row.world_size], fit_error=errors.get(row.world_size))
        for row in scaling_rows(steps_by_n, config.batch_size, per_device)
    ]
    load = MachineLoad.busiest(load_before, MachineLoad.now())
    unreliable = unreliable_reasons(rows, moved) + [
        f"{t.config} (measured): {reason}" for t in timings for reason in t.unreliable if "moved" in reason
    ]
    recommended = None if unreliable else recommend(rows, config.min_efficiency)

    assumptions = describe_assumptions(
        config,
        str(device),
        cores,
        param_count,
        buckets,
        sizes,
        beyond,
        factors,
        fit,
        raw_errors,
        local_link,
        remote_link,
        per_node,
    )
    inputs = {
        "device": str(device),
        "cores": cores,
        "parameters": param_count,
        "buckets_bytes": [b.nbytes for b in buckets],
        "measured_world_sizes": sizes,
        "measured": {str(t.devices): asdict(t) for t in timings},
        "extrapolated_world_sizes": beyond,
        "compute_factors": {str(n): f for n, f in factors.items()},
        "model_before_fit": {str(n): asdict(p) for n, p in raw_steps.items()},
        "fit": asdict(fit),
        "model_error_before_fit": {str(n): e for n, e in raw_errors.items()},
        "fit_error": {str(n): e for n, e in errors.items()},
        "link_samples": link_samples,
        "local_link": asdict(local_link) if local_link else None,
        "remote_link": asdict(remote_link) if remote_link else None,
        "per_node": per_node,
        "moved_between_repeats": {f"batch {b}, {t} threads": m for (b, t), m in moved.items()},
        "load_average": load.load_average,
    }
    report = PlanReport(asdict(config), rows, recommended, assumptions, inputs, unreliable=unreliable)
    report.budget = budget_notes(timings, config, config.steps, config.budget)
    progress.start("measuring memory")
    sample = work.sample_batch(1)[0].to(device)
    backend = "nccl" if device.type == "cuda" else "gloo"  # the backend a run here would use; zero3 reduces by it
    report.memory = measure_memory(model.to(device), sample, config.optimizer, config.momentum, per_device, backend)
    if config.validate:
        progress.start("validating against bench")
        report.validation = validate_plan(
            config,
            validation_configs(config.configs, config.max_world_size),
            {row.world_size: row.step_seconds for row in report.rows},
            config.max_error,
        )
    progress.done()
    if config.report_out:
        write_json(report.as_dict(), config.report_out)
        report.written.append(config.report_out)
    return report


def _shape(
    n: int, batch_size: int, gpus: list[torch.device], device: torch.device, per_node: int, cores: int
) -> tuple[int, int, float]:
    """(per-device batch, threads, time-sharing slowdown) of one process at world size ``n``."""
    batch = math.ceil(batch_size / n)  # the largest share sets the pace
    if gpus:  # one GPU per process: the host threads do not set the pace
        return batch, torch.get_num_threads(), 1.0
    if n == 1:  # what `paratrain train` gives one device: OMP_NUM_THREADS, else every core
        return batch, choose_threads("single", [device], launched=False), 1.0
    threads, slowdown = threads_per_process(min(n, per_node), cores)  # what `paratrain launch` gives each worker
    return batch, threads, slowdown


def _profile_steps(config: PlanConfig, step_seconds: float, runs: int, seconds: float) -> int:
    """Timed steps per round of the one-device profiles: ``--steps``, or fewer (at least 1: the rounds give a
    median of two or more) to fit ``seconds`` (``runs``: shapes x rounds, each step about ``step_seconds``)."""
    return max(1, min(config.steps, int(seconds / (max(step_seconds, 1e-6) * runs))))


def _running(word: str, repeats: int, probe: bool) -> str:
    then = ", then the all-reduce between its processes" if probe else ""
    return f"running {word} ({repeats} round{'s' * (repeats != 1)} at most){then}"


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def _probe_sizes(buckets: list[BucketSpec]) -> tuple[int, ...]:
    """Message sizes to time: small ones for the latency, large ones and the model's largest bucket for the
    bandwidth (the fit to the measured runs takes care of the rest)."""
    sizes = {1 << 12, 1 << 20, 1 << 24, max(b.nbytes for b in buckets)}
    return tuple(sorted(s - s % 4 for s in sizes if s >= 4))


def _remote_link(config: PlanConfig) -> Link | None:
    if config.link_file is not None:
        return fit_link([(int(n), int(b), float(t)) for n, b, t in read_link_file(config.link_file)])
    if config.link_bandwidth is not None and config.link_latency is not None:
        return Link(config.link_latency, config.link_bandwidth * 1e9)
    return None
