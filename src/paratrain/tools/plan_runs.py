"""``paratrain plan`` at the world sizes this machine can run: the real strategy for a few steps, as bench runs it.

    sizes = measured_sizes(max_world_size=4, per_node=4, gpus=0, cores=2, measure_up_to=None)   # [1, 2]
    timings = run_real(config, sizes, timed_seconds=4.0, on_run=progress_of_each_run)
    notes = budget_notes(timings, asked_steps=10, budget=40.0)

Each size runs the user's job (model, data, batch, optimizer, clipping) through :func:`paratrain.tools.bench
.time_configs`: single in this process, ``ddp:N`` in N processes the launcher starts as ``paratrain train`` does,
each at the threads train gives it; ``--warmup`` untimed steps, then timed ones, ``--repeats`` times round robin.
A run takes fewer timed steps than ``--steps`` (and fewer warm-up steps) when they would not fit its share of
plan's ``--budget``, and the repeats stop after two once every size's agree within :data:`SPREAD_NOTE`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from paratrain.tools.bench import MIN_TIMED_STEPS, BenchConfig, ConfigTiming, time_configs
from paratrain.tools.configs import RunConfig, parse_configs
from paratrain.tools.settings import RunSettings, TimingSettings

__all__ = ["SPREAD_NOTE", "bench_settings", "budget_notes", "measured_sizes", "run_order", "run_real", "run_words"]

# repeats of a measured size whose medians spread more than this: more steps would likely move its figure
SPREAD_NOTE = 0.10


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


def run_real(
    settings: RunSettings,
    sizes: list[int],
    timed_seconds: float | None,
    on_run: Callable[[RunConfig, int], None] | None = None,
) -> list[ConfigTiming]:
    """The timing of single and ddp at each of ``sizes`` (see the module docstring), in ``sizes``' order."""
    words = run_words(sizes)
    extra: dict[str, Any] = {} if timed_seconds is None else {"timed_seconds": timed_seconds}
    return time_configs(bench_settings(settings, words), parse_configs(words), extra, on_run, settle=SPREAD_NOTE)


def run_order(words: list[str], repeats: int) -> list[tuple[str, int]]:
    """(configuration, repeat) in the order :func:`run_real` runs them (the rotation of ``time_configs``)."""
    order = []
    for repeat in range(repeats):
        shift = repeat % len(words)
        order += [(word, repeat) for word in words[shift:] + words[:shift]]
    return order


def budget_notes(timings: list[ConfigTiming], settings: TimingSettings, asked_steps: int, budget: float) -> list[str]:
    """Whether a longer budget would change the measured figures: the runs cut short, and how far their repeats
    spread (beyond :data:`SPREAD_NOTE`, more steps would likely move the figure)."""
    ok = [t for t in timings if t.status == "OK"]
    if not ok:
        return []
    cut = [t for t in ok if t.timed_steps < asked_steps]
    spread = [t for t in ok if t.moved > SPREAD_NOTE]
    steps_text = ", ".join(f"{t.config} {t.timed_steps}" for t in ok)
    repeats = min(len(t.repeat_step_seconds) for t in ok)
    head = f"measured: {repeats} repeat(s) of {steps_text} timed steps"
    if repeats < settings.repeats:
        head += f" (not {settings.repeats}: the first {repeats} agreed within {SPREAD_NOTE:.0%})"
    if cut:
        head += (
            f"; the runs took fewer than --steps {asked_steps} to stay within --budget {budget:.0f} s (at least "
            f"{MIN_TIMED_STEPS})"
        )
    notes = [head]
    if spread:
        listed = ", ".join(f"{t.config} {t.moved:.0%}" for t in spread)
        notes.append(
            f"a longer budget would likely change the answer: the repeats' medians spread ({listed}, more than "
            f"{SPREAD_NOTE:.0%}); run again with a larger --budget (or --steps/--repeats) on a quieter machine"
        )
    else:
        largest = max(t.moved for t in ok)
        notes.append(
            f"a longer budget would not change the answer by much: every measured size's repeats agree within "
            f"{largest:.0%}"
        )
    return notes
