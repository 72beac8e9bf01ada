"""``paratrain bench``: how fast is each configuration on the user's model, and where does its step go?

    paratrain bench                                             # every configuration this machine can run
    paratrain bench --model mlp --width 2048 --configs single ddp:2 --report-out bench.json
    paratrain bench --steps 50 --repeats 5 --markdown-out bench.md --plot-out bench.png
    paratrain bench --model mlp --width 2048 --optimizer adamw --configs ddp:2 zero1:2 zero2:2 zero3:2

Each configuration runs ``--warmup`` untimed steps, then ``--steps`` timed ones, and that ``--repeats`` times,
round robin over the configurations (the order rotating each round) so that drift of a shared machine hits all of
them alike. Each step is split into data wait, forward (with the loss), backward (with the synchronisation it
does not hide) and optimizer; the report gives each repeat's mean step (its throughput, as ``train`` counts
samples/s: a median would leave out the slow steps every ddp rank waits for), the median over repeats,
samples/s, and speed-up and scaling efficiency against ``single``, which is added when not listed.

Every configuration computes with the threads ``paratrain train`` would give it (one process: the cores it may
use; dp's CPU replicas: the cores shared among them; launched ranks: what the launcher set), so that ``single`` is
not measured with OpenMP threads spinning beside other work. The report records the threads, the cores and the
load average before and after, and marks a configuration **unreliable**, in the table and the JSON, when its
figures cannot be true or did not hold still: an efficiency above 100% (N devices more than N times faster than
one, which a busy baseline fakes), or a step that moved between repeats by more than
:data:`~paratrain.tools.plan_report.MOVED_BOUND` of itself.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ConfigError
from paratrain.files import check_output
from paratrain.parallel import Parallel
from paratrain.settings import setting
from paratrain.tools.configs import RunConfig, parse_configs, unavailable_reason
from paratrain.tools.plan_report import MOVED_BOUND
from paratrain.tools.report import format_markdown, format_table, write_json, write_text
from paratrain.tools.runner import ConfigRunError, run_config
from paratrain.tools.settings import RunSettings, TimingSettings, settings_from
from paratrain.tools.workload import Workload, build_optimizer, endless
from paratrain.training.logs import install_hint
from paratrain.training.threads import MachineLoad, choose_threads, using_threads

__all__ = [
    "MIN_TIMED_STEPS",
    "PHASES",
    "BenchConfig",
    "BenchReport",
    "ConfigTiming",
    "TimedSteps",
    "agreed",
    "bench",
    "summarise_timings",
    "time_configs",
]

PHASES = ("data", "forward", "backward", "optimizer")
MIN_TIMED_STEPS = 3  # a run cut short by plan's budget still times this many steps


@dataclass
class BenchConfig(TimingSettings, RunSettings):
    """Settings of ``paratrain bench``."""

    markdown_out: str | None = setting(
        None, "write the table as Markdown (default: beside --report-out, as .md)", metavar="FILE.md"
    )
    plot_out: str | None = setting(
        None,
        "write a PNG plot of samples/s and efficiency against devices (needs matplotlib: "
        f"{install_hint('plot')}; default: beside --report-out, as .png, when matplotlib is installed)",
        metavar="FILE.png",
    )

    def check_group(self) -> None:
        for flag, path in (("--markdown-out", self.markdown_out), ("--plot-out", self.plot_out)):
            if path is not None:
                check_output(path, flag)
        if self.plot_out is not None and not plotting_available():
            raise ConfigError(
                f"--plot-out {self.plot_out} needs matplotlib, which is not installed: {install_hint('plot')}, or "
                "drop --plot-out"
            )


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- one timed run (here, or in each ddp rank) -------------------------------------------------------------------


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_in(par: Parallel, settings: BenchConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """``warmup`` + ``steps`` steps under ``par``, on the threads ``train`` would use; seconds of each phase.

    ``extra["timed_seconds"]`` (plan's budget): fewer timed steps when ``steps`` of them would take longer than
    that, judged by the first timed step, but at least :data:`MIN_TIMED_STEPS`, and fewer warm-up steps (at
    least one) when they would take more than half of it, judged by the first step (the ranks agree on both).
    """
    threads = choose_threads(par.strategy_name, par.strategy.devices, launched=par.environment.launched)
    with using_threads(threads):
        return _timed_steps(par, settings, extra.get("timed_seconds"))


class TimedSteps:
    """The run's job prepared under ``par``, one optimizer step at a time, each phase timed: bench's loop, and
    plan's (:func:`paratrain.tools.plan_runs.run_rounds_in`)."""

    def __init__(self, par: Parallel, settings: RunSettings) -> None:
        self.par, self.settings = par, settings
        self.work = Workload.load(settings)
        model = self.work.build_model()
        optimizer = build_optimizer(settings, model.parameters())
        self.model, self.optimizer, loader = par.prepare(model, optimizer, self.work.loader())
        self.sync = _synchronizer(par.device)
        self.batches = endless(loader)

    def step(self) -> dict[str, float]:
        """One optimizer step; the seconds of each of :data:`PHASES`."""
        par, model, sync = self.par, self.model, self.sync
        t0 = time.perf_counter()
        batch = next(self.batches)
        sync()
        spent = dict.fromkeys(PHASES, 0.0)
        spent["data"] = time.perf_counter() - t0
        for inputs, targets in par.accumulate(model, batch, steps=self.settings.accumulate):
            t1 = time.perf_counter()
            loss = self.work.loss(model(inputs), targets)
            sync()
            t2 = time.perf_counter()
            par.backward(loss)  # under ddp, on the last micro-batch: returns when every bucket is averaged
            sync()
            spent["forward"] += t2 - t1
            spent["backward"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        if self.settings.clip_grad_norm is not None:
            par.clip_grad_norm_(model, self.settings.clip_grad_norm)
        par.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        spent["optimizer"] = time.perf_counter() - t3
        return spent


def _timed_steps(par: Parallel, settings: BenchConfig, timed_seconds: float | None = None) -> dict[str, Any]:
    loop = TimedSteps(par, settings)
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    warmup, steps = settings.warmup, settings.steps
    i = 0
    while i < warmup + steps:
        spent = loop.step()
        if i >= warmup:
            for name in PHASES:
                phases[name].append(spent[name])
        if timed_seconds is not None and i in (0, warmup):
            seconds = max(sum(spent.values()), 1e-9)
            if i == warmup:  # the first timed step: how many fit the budget
                steps = agreed(par, min(steps, max(MIN_TIMED_STEPS, int(timed_seconds / seconds))))
            else:  # the first step (an upper bound: it allocates): warm-up beyond one step within half the budget
                warmup = agreed(par, min(warmup, max(1, int(timed_seconds / 2 / seconds))))
        i += 1
    return {
        "phases": phases,
        "threads": torch.get_num_threads(),
        "device": str(par.device),
        "steps": steps,
        "warmup": warmup,
    }


def agreed(par: Parallel, count: int) -> int:
    """The smallest of every rank's ``count``: the ranks must run the same steps (each has collectives)."""
    return int(par.all_reduce(torch.tensor([float(count)], device=par.device), "min").item())


# -- the report ----------------------------------------------------------------------------------------------------


@dataclass
class ConfigTiming:
    """One configuration's figures (the median over repeats of each repeat's mean); speed-up and efficiency are
    against single's step time."""

    config: str
    strategy: str
    devices: int
    status: str = "OK"  # OK, SKIPPED, ERROR
    reason: str = ""
    step_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    samples_per_second: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0
    repeat_step_seconds: list[float] = field(default_factory=list)  # the mean step of each repeat (round_step)
    threads_per_process: int = 0
    timed_steps: int = 0  # timed steps per repeat (the fewest of any repeat)
    unreliable: list[str] = field(default_factory=list)  # why these figures cannot be trusted, if they cannot

    @property
    def moved(self) -> float:
        """How far the repeats' steps spread, as a fraction of their median (0 with one repeat)."""
        steps = self.repeat_step_seconds
        return (max(steps) - min(steps)) / self.step_seconds if len(steps) > 1 and self.step_seconds else 0.0

    def judge(self, bound: float = MOVED_BOUND) -> None:
        """Fill :attr:`unreliable`: an efficiency no N devices can reach, or repeats that did not hold still."""
        self.unreliable = []
        if self.devices > 1 and self.efficiency > 1.0:
            self.unreliable.append(
                f"efficiency {self.efficiency:.0%}: {self.devices} devices measured {self.speedup:.2f}x faster than "
                "one, more than they can be (the baseline ran slow)"
            )
        if self.moved > bound:
            self.unreliable.append(f"its step moved by {self.moved:.0%} between repeats (more than {bound:.0%})")


@dataclass
class BenchReport:
    settings: dict[str, Any]
    timings: list[ConfigTiming]
    notes: list[str]
    written: list[str] = field(default_factory=list)  # the files written: JSON, Markdown, PNG
    machine: dict[str, Any] = field(default_factory=dict)  # cores, and the load average before and after

    @property
    def ok(self) -> bool:
        return all(t.status != "ERROR" for t in self.timings)

    @property
    def reliable(self) -> bool:
        """No configuration's figures were marked unreliable."""
        return not any(t.unreliable for t in self.timings)

    def timing(self, config: str) -> ConfigTiming:
        return next(t for t in self.timings if t.config == config)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": "bench",
            "ok": self.ok,
            "reliable": self.reliable,
            "machine": self.machine,
            "settings": self.settings,
            "notes": self.notes,
            "configs": [asdict(t) for t in self.timings],
        }

    def rows(self) -> tuple[list[str], list[list[str]]]:
        headers = [
            "configuration",
            "devices",
            "step ms",
            "data",
            "forward",
            "backward+sync",
            "optimizer",
            "samples/s",
            "speed-up",
            "efficiency",
            "threads",
        ]
        rows = []
        for t in self.timings:
            if t.status != "OK":
                rows.append([t.config, str(t.devices), f"{t.status}: {t.reason}"] + [""] * 8)
                continue
            p = t.phase_seconds
            mark = " unreliable" if t.unreliable else ""
            rows.append(
                [t.config, str(t.devices), f"{t.step_seconds * 1e3:.2f}"]
                + [f"{p[name] * 1e3:.2f}" for name in PHASES]
                + [f"{t.samples_per_second:,.0f}", f"{t.speedup:.2f}x{mark}", f"{t.efficiency:.0%}{mark}"]
                + [str(t.threads_per_process)]
            )
        return headers, rows

    def render(self) -> str:
        headers, rows = self.rows()
        s = self.settings
        lines = [
            format_table(headers, rows),
            f"each repeat's mean step (its throughput), the median of {s['repeats']} round-robin repeats x "
            f"{s['steps']} steps after {s['warmup']} warm-up steps; "
            f"global batch {s['batch_size']}; phases in ms per step; threads per process",
            *self.notes,
            *self.warnings(),
        ]
        return "\n".join(lines)

    def warnings(self) -> list[str]:
        """One line per unreliable configuration, and what to do about it."""
        lines = [f"unreliable: {t.config}: {'; '.join(t.unreliable)}" for t in self.timings if t.unreliable]
        if lines:
            load = self.machine.get("load_average_after")
            busy = f" (load average {load:.1f} on {self.machine.get('cores')} cores)" if load is not None else ""
            lines.append(
                f"other work on this machine{busy} changes what a step costs while bench measures it: run bench "
                "again with nothing else running, or with more --repeats"
            )
        return lines

    def markdown(self) -> str:
        headers, rows = self.rows()
        notes = [*self.notes, *self.warnings()]
        return format_markdown(headers, rows) + "\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def round_step(run: dict[str, Any]) -> float:
    """A repeat's step: the mean of its timed steps, which is its samples/s as ``train`` counts them (samples over
    time). A median would leave out the slow steps, and under ddp every rank waits for the slowest rank's step, so
    ddp's steps are skewed: SimpleNet's ddp:2 at 2 ranks on 2 cores, median 4.8 ms, mean 5.5 ms (+16%)."""
    return statistics.fmean(sum(step) for step in zip(*run["phases"].values(), strict=True))


def _spread(runs: list[dict[str, Any]]) -> float:
    """How far the runs' steps spread, as a fraction of their median (what :attr:`ConfigTiming.moved` is)."""
    steps = [round_step(run) for run in runs]
    middle = statistics.median(steps) if steps else 0.0
    return (max(steps) - min(steps)) / middle if len(steps) > 1 and middle > 0 else 0.0


def _summarise(config: RunConfig, runs: list[dict[str, Any]], batch_size: int) -> ConfigTiming:
    per_repeat = [round_step(run) for run in runs]
    phase_means: dict[str, list[float]] = {name: [] for name in PHASES}
    for run in runs:
        for name in PHASES:
            phase_means[name].append(statistics.fmean(run["phases"][name]))
    step = statistics.median(per_repeat)
    return ConfigTiming(
        config.word,
        config.strategy,
        config.device_count,
        step_seconds=step,
        phase_seconds={name: statistics.median(v) for name, v in phase_means.items()},
        samples_per_second=batch_size / step,
        repeat_step_seconds=per_repeat,
        threads_per_process=int(runs[0].get("threads", 0)),
        timed_steps=min(int(run.get("steps", len(run["phases"]["data"]))) for run in runs),
    )


def time_configs(
    config: BenchConfig,
    configs: list[RunConfig],
    extra: dict[str, Any] | None = None,
    on_run: Callable[[RunConfig, int], None] | None = None,
    settle: float | None = None,
) -> list[ConfigTiming]:
    """Time each of ``configs`` ``config.repeats`` times, round robin (the order rotating each round); one timing
    each, judged, with speed-up and efficiency against the first OK ``single`` among them.

    ``extra`` goes to every run (:func:`run_in`); ``on_run(configuration, repeat)`` is called before each run.
    ``settle`` (plan): stop after two rounds or more once every configuration's repeats agree within that
    fraction of their median (more repeats would not change the answer).
    """
    runnable = [c for c in configs if unavailable_reason(c) is None]
    runs: dict[str, list[dict[str, Any]]] = {c.word: [] for c in runnable}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as tmp:
        for repeat in range(config.repeats):
            shift = repeat % len(runnable) if runnable else 0
            for run in runnable[shift:] + runnable[:shift]:  # rotate: no configuration always goes first
                if run.word in errors:
                    continue
                if on_run is not None:
                    on_run(run, repeat)
                try:
                    runs[run.word].append(run_config(run_in, config, run, Path(tmp), extra or {})[0])
                except ConfigRunError as exc:
                    errors[run.word] = str(exc)
            if settle is not None and repeat >= 1 and all(_spread(runs[w]) <= settle for w in runs if w not in errors):
                break
    return summarise_timings(configs, runs, errors, config.batch_size)


def summarise_timings(
    configs: list[RunConfig], runs: dict[str, list[dict[str, Any]]], errors: dict[str, str], batch_size: int
) -> list[ConfigTiming]:
    """One timing per configuration from its runs (each a dict of phase lists), judged, with speed-up and efficiency
    against the first OK ``single``; SKIPPED where it cannot run here, ERROR with its message in ``errors``."""
    timings = []
    for c in configs:
        why_not = unavailable_reason(c)
        if why_not is not None:
            timings.append(ConfigTiming(c.word, c.strategy, c.device_count, "SKIPPED", why_not))
        elif c.word in errors:
            timings.append(ConfigTiming(c.word, c.strategy, c.device_count, "ERROR", errors[c.word]))
        else:
            timings.append(_summarise(c, runs[c.word], batch_size))
    base = next((t for t in timings if t.strategy == "single" and t.status == "OK"), None)
    for t in timings:
        if t.status == "OK" and base is not None:
            t.speedup = base.step_seconds / t.step_seconds
            t.efficiency = t.speedup / t.devices
        if t.status == "OK":
            t.judge()
    return timings


def bench(config: BenchConfig | None = None, /, **settings: Any) -> BenchReport:
    """Measure every configuration; see the module docstring. ``bench(model="mlp", configs=[...])`` works too.

    Raises:
        ConfigError: settings no run can use.
    """
    config = settings_from(BenchConfig, config, settings)
    configs = parse_configs(config.configs)
    notes: list[str] = []
    if not any(c.strategy == "single" for c in configs):
        configs.insert(0, parse_configs(["single"])[0])
        notes.append("single was added: speed-up and efficiency are measured against it")
    runnable = [c for c in configs if unavailable_reason(c) is None]
    before = MachineLoad.now()
    timings = time_configs(config, configs)
    after = MachineLoad.now()
    machine = {
        "cores": after.cores,
        "load_average_before": before.load_average,
        "load_average_after": after.load_average,
    }
    cores = os.cpu_count() or 1
    launched = [c for c in runnable if not c.in_process]
    if launched and not torch.cuda.is_available():
        given = os.environ.get("OMP_NUM_THREADS")
        each = ", ".join(
            f"{c.word}: {n} thread{'s' * (n != 1)} each"
            for c in launched
            for n in [int(given) if given and given.isdigit() else max(1, cores // c.processes)]
        )
        notes.append(
            f"on the CPU, the processes of ddp (zero1, zero2, zero3) share this machine's {cores} cores ({each}): they "
            "add no compute here, only communication"
        )
    if any(c.strategy == "dp" and "cpu" in c.devices for c in runnable):
        notes.append(
            f"dp's CPU replicas are threads on the same {cores} cores: they exercise the parallel code but add no "
            "compute"
        )
    report = BenchReport(asdict(config), timings, notes, machine=machine)
    _write_outputs(report, config)
    return report


def _write_outputs(report: BenchReport, config: BenchConfig) -> None:
    beside = Path(config.report_out) if config.report_out else None
    markdown = config.markdown_out or (str(beside.with_suffix(".md")) if beside is not None else None)
    plot = config.plot_out
    if plot is None and beside is not None:
        if plotting_available():
            plot = str(beside.with_suffix(".png"))
        else:
            report.notes.append(f"no plot: matplotlib is not installed ({install_hint('plot')})")
    if beside is not None:
        write_json(report.as_dict(), beside)
        report.written.append(str(beside))
    if markdown:
        write_text(report.markdown(), markdown)
        report.written.append(markdown)
    if plot:
        from paratrain.tools.plot import plot_scaling  # matplotlib is an optional extra

        measured = [t for t in report.timings if t.status == "OK"]
        single = next((t.samples_per_second for t in measured if t.strategy == "single"), None)
        series = {
            strategy: [(t.devices, t.samples_per_second, t.efficiency) for t in measured if t.strategy == strategy]
            for strategy in ("dp", "ddp", "zero1", "zero2", "zero3")
        }
        title = f"paratrain bench: {config.model}, global batch {config.batch_size}"
        plot_scaling(series, single, title, plot)
        report.written.append(plot)
