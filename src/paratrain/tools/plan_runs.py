"""``paratrain plan`` at the world sizes this machine can run: the real strategy, as bench and train run it.

    sizes = measured_sizes(max_world_size=4, per_node=4, gpus=0, cores=2, measure_up_to=None)   # [1, 2]
    timings, link = run_real(config, sizes, round_seconds=3.5, on_run=progress_of_each_size, link_sizes=(4096,))
    notes = budget_notes(timings, config, asked_steps=10, budget=40.0)

Each size runs the user's job (model, data, batch, optimizer, clipping) through bench's step loop
(:class:`paratrain.tools.bench.TimedSteps`): single in this process, ``ddp:N`` in N processes the launcher starts as
``paratrain train`` does, each at the threads train gives it. One run per size (one launch: starting N processes
and building the model cost more than a few steps of most models) runs ``--warmup`` untimed steps, then up to
``--repeats`` rounds of timed steps (:func:`run_rounds_in`), and stops after two once the rounds' steps agree
within :data:`SPREAD_NOTE` (every rank agreeing). A round takes the steps that fit its share of plan's
``--budget``: fewer than ``--steps`` for a slow model (at least one: with two rounds or more the figure is still
of two steps or more, and the rounds' agreement says whether more would move it), more for a step so short that
``--steps`` of them would last less than :data:`MIN_ROUND_SECONDS` (ten 1 ms steps measure the load of those
10 ms). A round's step is the mean of its steps, its throughput as train counts it
(:func:`paratrain.tools.bench.round_step`); the size's figure is the median of its rounds. The largest size's
run also times the all-reduce between its processes (:func:`paratrain.tools.allreduce_probe.measure`) when plan
extrapolates, instead of a launch of its own.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from paratrain.parallel import Parallel
from paratrain.tools.allreduce_probe import measure as measure_all_reduce
from paratrain.tools.bench import (
    PHASES,
    BenchConfig,
    ConfigTiming,
    TimedSteps,
    agreed,
    round_step,
    summarise_timings,
)
from paratrain.tools.configs import RunConfig, parse_configs, unavailable_reason
from paratrain.tools.runner import ConfigRunError, run_config
from paratrain.tools.settings import RunSettings, TimingSettings
from paratrain.training.threads import choose_threads, using_threads

__all__ = [
    "MIN_ROUND_SECONDS",
    "SPREAD_NOTE",
    "bench_settings",
    "budget_notes",
    "measured_sizes",
    "round_steps",
    "rounds_settled",
    "run_real",
    "run_rounds_in",
    "run_words",
]

# repeats of a measured size whose steps spread more than this: more steps would likely move its figure
SPREAD_NOTE = 0.10
# a round of steps shorter than this takes more than --steps (within its share of --budget): a tiny step's mean
# over a few milliseconds is the machine's load at that moment, not the step
MIN_ROUND_SECONDS = 1.0


def measured_sizes(max_world_size: int, per_node: int, gpus: int, cores: int, measure_up_to: int | None) -> list[int]:
    """The world sizes plan runs for real: up to this machine's GPUs (one per process), else its cores, or up to
    ``measure_up_to`` when given (on the CPU it may exceed the cores: the processes then time-share them)."""
    most = gpus if gpus else cores
    if measure_up_to is not None:
        most = min(measure_up_to, gpus) if gpus else measure_up_to
    return list(range(1, max(1, min(max_world_size, per_node, most)) + 1))


def run_words(sizes: list[int]) -> list[str]:
    """The configurations of ``sizes``: single, ddp:2, ddp:3, ..."""
    return ["single", *(f"ddp:{n}" for n in sizes if n > 1)]


def bench_settings(settings: RunSettings, words: list[str]) -> BenchConfig:
    """bench's settings for ``words`` with the model, data, step and timing of ``settings`` (plan's)."""
    bench_fields = {f.name for f in fields(BenchConfig)} - {"configs", "report_out", "markdown_out", "plot_out"}
    shared = {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in bench_fields}  # type: ignore[arg-type]
    return BenchConfig(**shared, configs=words)


def round_steps(asked: int, step_seconds: float, round_seconds: float | None) -> int:
    """Timed steps per round, from the first timed step's ``step_seconds``: ``asked`` (``--steps``), fewer (at least
    one) when they would take longer than ``round_seconds`` (the round's share of the budget), more when they would
    take less than :data:`MIN_ROUND_SECONDS` (up to what fits ``round_seconds``)."""
    step_seconds = max(step_seconds, 1e-9)
    fit = int(round_seconds / step_seconds) if round_seconds is not None else None
    steps = asked if fit is None else min(asked, max(1, fit))
    short = int(MIN_ROUND_SECONDS / step_seconds)
    if short > steps:
        steps = short if fit is None else max(steps, min(short, fit))
    return steps


def rounds_settled(steps: list[float], settle: float) -> bool:
    """Whether two or more rounds' steps agree within ``settle`` of their median (more would not move it)."""
    if len(steps) < 2:
        return False
    middle = statistics.median(steps)
    return middle > 0 and (max(steps) - min(steps)) / middle <= settle


def run_rounds_in(par: Parallel, settings: BenchConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """One size of plan (here, or in each ddp rank): warm-up, then up to ``extra["rounds"]`` rounds of timed steps,
    stopped once :func:`rounds_settled` by ``extra["settle"]``; then, with ``extra["link_sizes"]`` and more than one
    process, all-reduces of those sizes timed between the processes. At the threads train gives the run.

    Returns ``{"runs": [one dict per round, as bench's runs], "link": [[n, bytes, seconds], ...]}``.
    """
    threads = choose_threads(par.strategy_name, par.strategy.devices, launched=par.environment.launched)
    with using_threads(threads):
        loop = TimedSteps(par, settings)
        round_seconds = extra.get("timed_seconds")
        warmup = settings.warmup
        if warmup:
            first = sum(loop.step().values())  # an upper bound (it allocates): warm-up within half a round's share
            if round_seconds is not None:
                warmup = agreed(par, min(warmup, max(1, int(round_seconds / 2 / max(first, 1e-9)))))
            for _ in range(warmup - 1):
                loop.step()
        runs: list[dict[str, Any]] = []
        steps = 0
        while len(runs) < int(extra.get("rounds", 1)):
            phases: dict[str, list[float]] = {name: [] for name in PHASES}
            i = 0
            while i < max(steps, 1):
                spent = loop.step()
                for name in PHASES:
                    phases[name].append(spent[name])
                if not steps:  # the first timed step: how many steps a round takes
                    steps = agreed(par, round_steps(settings.steps, sum(spent.values()), round_seconds))
                i += 1
            runs.append({"phases": phases, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads()})
            steps_seen = [round_step(r) for r in runs]
            if agreed(par, int(rounds_settled(steps_seen, float(extra.get("settle", 0.0))))):
                break
        link: list[list[float]] = []
        if extra.get("link_sizes") and par.world_size > 1:
            link = measure_all_reduce(tuple(extra["link_sizes"]), par.device)
    return {"runs": runs, "link": link}


def run_real(
    settings: RunSettings,
    sizes: list[int],
    round_seconds: float | None,
    on_run: Callable[[RunConfig], None] | None = None,
    link_sizes: tuple[int, ...] = (),
) -> tuple[list[ConfigTiming], list[list[float]]]:
    """The timing of single and ddp at each of ``sizes`` (see the module docstring), in ``sizes``' order, and the
    all-reduce timings of the largest size's processes (``[[n, bytes, seconds], ...]``; none without
    ``link_sizes`` or with one size)."""
    words = run_words(sizes)
    configs = parse_configs(words)
    bench = bench_settings(settings, words)
    timing: dict[str, Any] = {"rounds": bench.repeats, "settle": SPREAD_NOTE}
    if round_seconds is not None:
        timing["timed_seconds"] = round_seconds
    runs: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    link: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-plan-") as tmp:
        for config in configs:
            if unavailable_reason(config) is not None:
                continue
            if on_run is not None:
                on_run(config)
            probe = list(link_sizes) if config is configs[-1] and config.processes > 1 else []
            try:
                result = run_config(run_rounds_in, bench, config, Path(tmp), {**timing, "link_sizes": probe})[0]
            except ConfigRunError as exc:
                errors[config.word] = str(exc)
                continue
            runs[config.word] = result["runs"]
            link = result["link"] or link
    return summarise_timings(configs, runs, errors, settings.batch_size), link


def budget_notes(timings: list[ConfigTiming], settings: TimingSettings, asked_steps: int, budget: float) -> list[str]:
    """Whether a longer budget would change the measured figures: the runs cut short, and how far their repeats
    spread (beyond :data:`SPREAD_NOTE`, more steps would likely move the figure)."""
    ok = [t for t in timings if t.status == "OK"]
    if not ok:
        return []
    cut = [t for t in ok if t.timed_steps < asked_steps]
    more = [t for t in ok if t.timed_steps > asked_steps]
    spread = [t for t in ok if t.moved > SPREAD_NOTE]
    steps_text = ", ".join(f"{t.config} {len(t.repeat_step_seconds)} x {t.timed_steps}" for t in ok)
    head = f"measured: one run per size, rounds x timed steps after the warm-up: {steps_text}"
    if any(len(t.repeat_step_seconds) < settings.repeats for t in ok):
        head += f" (fewer rounds than --repeats {settings.repeats}: the first agreed within {SPREAD_NOTE:.0%})"
    if cut:
        head += (
            f"; {', '.join(t.config for t in cut)} took fewer than --steps {asked_steps} a round to stay within "
            f"--budget {budget:.0f} s"
        )
    if more:
        head += (
            f"; {', '.join(t.config for t in more)} took more than --steps {asked_steps}, so that a round lasts "
            f"about {MIN_ROUND_SECONDS:.0f} s"
        )
    notes = [head]
    if spread:
        listed = ", ".join(f"{t.config} {t.moved:.0%}" for t in spread)
        notes.append(
            f"a longer budget would likely change the answer: the repeats' steps spread ({listed}, more than "
            f"{SPREAD_NOTE:.0%}); run again with a larger --budget (or --steps/--repeats) on a quieter machine"
        )
    else:
        largest = max(t.moved for t in ok)
        notes.append(
            f"a longer budget would not change the answer by much: every measured size's repeats agree within "
            f"{largest:.0%}"
        )
    return notes
