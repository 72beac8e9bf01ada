"""plan's fit to the measured runs, the rows' labels, the budget notes, and its progress lines (a real pipe, a pty)."""

from __future__ import annotations

import os
import pty
import select

import pytest

from paratrain.tools.bench import ConfigTiming, round_step, summarise_timings
from paratrain.tools.configs import parse_configs
from paratrain.tools.plan_fit import CommFit, MeasuredPoint, compute_factor, fit_errors, fit_overhead
from paratrain.tools.plan_model import ScalingRow, ring_factor
from paratrain.tools.plan_progress import PhaseProgress
from paratrain.tools.plan_report import PlanReport
from paratrain.tools.plan_runs import (
    MIN_ROUND_SECONDS,
    budget_notes,
    measured_sizes,
    round_steps,
    rounds_settled,
    run_words,
)
from paratrain.tools.settings import TimingSettings

# --- the fit ----------------------------------------------------------------------------------------------------------


def test_nothing_measured_fits_nothing():
    fit = fit_overhead([MeasuredPoint(1, 0.010, 0.012)])  # world size 1 has no communication to fit
    assert fit == CommFit() and fit.extra(4) == 0.0


def test_one_measured_ddp_size_fits_a_constant_that_matches_it():
    point = MeasuredPoint(2, modelled=0.040, measured=0.052)
    fit = fit_overhead([point])
    assert fit.constant == pytest.approx(0.012) and fit.per_ring == 0.0 and fit.points == 1
    assert fit.extra(1) == 0.0 and fit.extra(8) == pytest.approx(0.012)
    assert fit_errors(fit, [point]) == {2: pytest.approx(0.0)}
    assert point.model_error == pytest.approx(0.040 / 0.052 - 1)


def test_several_sizes_fit_a_line_in_the_ring_factor():
    constant, per_ring = 0.002, 0.006
    points = [MeasuredPoint(n, 0.05, 0.05 + constant + per_ring * ring_factor(n)) for n in (2, 3, 4)]
    fit = fit_overhead(points)
    assert fit.constant == pytest.approx(constant) and fit.per_ring == pytest.approx(per_ring)
    assert fit.extra(8) == pytest.approx(constant + per_ring * ring_factor(8))
    assert all(abs(e) < 1e-9 for e in fit_errors(fit, points).values())


def test_the_fit_error_at_measured_sizes_is_reported_when_the_line_cannot_pass_through_them():
    points = [MeasuredPoint(2, 0.05, 0.060), MeasuredPoint(3, 0.05, 0.058), MeasuredPoint(4, 0.05, 0.070)]
    errors = fit_errors(fit_overhead(points), points)
    assert set(errors) == {2, 3, 4} and max(abs(e) for e in errors.values()) > 0.01


def test_the_compute_factor_is_measured_over_profiled_and_1_without_both():
    assert compute_factor(0.03, 0.02) == pytest.approx(1.5)
    assert compute_factor(0.0, 0.02) == 1.0 and compute_factor(0.03, 0.0) == 1.0


# --- which sizes are measured, and the labels -------------------------------------------------------------------------


def test_measured_sizes_are_the_gpus_or_the_cores_or_what_the_user_allows():
    assert measured_sizes(4, per_node=4, gpus=0, cores=2, measure_up_to=None) == [1, 2]
    assert measured_sizes(8, per_node=8, gpus=0, cores=16, measure_up_to=None) == list(range(1, 9))
    assert measured_sizes(4, per_node=4, gpus=0, cores=2, measure_up_to=3) == [1, 2, 3]  # time-shared cores
    assert measured_sizes(32, per_node=8, gpus=8, cores=64, measure_up_to=None) == list(range(1, 9))
    assert measured_sizes(4, per_node=4, gpus=2, cores=64, measure_up_to=8) == [1, 2]  # no more GPUs than there are
    assert measured_sizes(4, per_node=1, gpus=0, cores=16, measure_up_to=None) == [1]
    assert run_words([1, 2, 3]) == ["single", "ddp:2", "ddp:3"]


def test_a_round_takes_the_steps_that_fit_its_share_and_at_least_a_second_of_tiny_ones():
    assert round_steps(10, 0.050, round_seconds=3.5) == 20  # 10 steps last 0.5 s: a round of about 1 s
    assert round_steps(10, 0.200, round_seconds=3.5) == 10  # --steps last 2 s: as asked
    assert round_steps(10, 1.3, round_seconds=3.5) == 2  # --steps would not fit the share: what fits, at least 1
    assert round_steps(10, 5.0, round_seconds=3.5) == 1
    assert round_steps(10, 0.001, round_seconds=0.5) == 500  # tiny steps: a second's worth, within the share
    assert round_steps(10, 0.001, round_seconds=None) == int(MIN_ROUND_SECONDS / 0.001)
    assert round_steps(10, 0.5, round_seconds=None) == 10


def test_rounds_settle_once_two_or_more_agree():
    assert not rounds_settled([0.100], 0.10)  # one round says nothing of the next
    assert rounds_settled([0.100, 0.105], 0.10)
    assert not rounds_settled([0.100, 0.130], 0.10)
    assert rounds_settled([0.100, 0.130, 0.104, 0.101, 0.102], 0.35) and not rounds_settled([0.1, 0.13, 0.1], 0.2)


def test_a_rounds_step_is_its_throughput_the_mean_not_the_median():
    """Under ddp every rank waits for the slowest rank's step: a few slow steps are part of what train measures."""
    steps = [0.004, 0.004, 0.004, 0.004, 0.014]  # one step in five waits 10 ms longer: 6 ms a step on average
    run = {"phases": {"data": [0.0] * 5, "forward": steps, "backward": [0.0] * 5, "optimizer": [0.0] * 5}}
    assert round_step(run) == pytest.approx(0.006)
    (timing,) = summarise_timings(parse_configs(["single"]), {"single": [run, run]}, {}, batch_size=60)
    assert timing.step_seconds == pytest.approx(0.006)
    assert timing.samples_per_second == pytest.approx(60 / 0.006)  # what train's samples over time gives
    assert timing.phase_seconds["forward"] == pytest.approx(0.006)


def _rows() -> list[ScalingRow]:
    return [
        ScalingRow(1, 64, 0.100, 640.0, 1.0, 1.0, 0.0, 0.0, "measured", None),
        ScalingRow(2, 32, 0.080, 800.0, 1.25, 0.625, 0.02, 0.02, "measured", 0.0),
        ScalingRow(3, 22, 0.070, 914.0, 1.43, 0.476, 0.03, 0.04, "extrapolated", None),
    ]


def test_the_table_labels_measured_and_extrapolated_rows_and_prints_the_fit_error():
    report = PlanReport({"min_efficiency": 0.5, "max_error": 0.15}, _rows(), 2, [], {})
    lines = report.render().splitlines()
    assert "source" in lines[0] and "fit error" in lines[0]
    one, two, three = (next(line for line in lines if line.startswith(f"{n} ")) for n in (1, 2, 3))
    assert one.split()[-2:] == ["measured", "-"]
    assert two.split()[-2:] == ["measured", "+0%"]
    assert three.split()[-2:] == ["extrapolated", "-"]
    assert [r["source"] for r in report.as_dict()["rows"]] == ["measured", "measured", "extrapolated"]


def _timing(config: str, devices: int, repeats: list[float], steps: int) -> ConfigTiming:
    ordered = sorted(repeats)
    return ConfigTiming(
        config,
        "single" if devices == 1 else "ddp",
        devices,
        step_seconds=ordered[len(ordered) // 2],
        repeat_step_seconds=repeats,
        timed_steps=steps,
    )


def test_the_budget_notes_say_whether_a_longer_budget_would_change_the_answer():
    settings = TimingSettings(warmup=3, repeats=3)
    steady = [_timing("single", 1, [0.100, 0.102], 3), _timing("ddp:2", 2, [0.080, 0.081], 3)]
    notes = budget_notes(steady, settings, asked_steps=10, budget=40.0)
    assert notes[0].startswith(
        "measured: one run per size, rounds x timed steps after the warm-up: single 2 x 3, ddp:2 2 x 3 (fewer rounds "
        "than --repeats 3: the first agreed within 10%)"
    )
    assert "single, ddp:2 took fewer than --steps 10 a round to stay within --budget 40 s" in notes[0]
    assert notes[1].startswith("a longer budget would not change the answer by much")
    moving = [_timing("single", 1, [0.100, 0.130, 0.110], 10), _timing("ddp:2", 2, [0.080, 0.081, 0.080], 400)]
    notes = budget_notes(moving, settings, asked_steps=10, budget=40.0)
    assert "--budget" not in notes[0] and "fewer rounds" not in notes[0]  # not cut, every round run
    assert "; ddp:2 took more than --steps 10, so that a round lasts about 1 s" in notes[0]
    assert notes[1].startswith("a longer budget would likely change the answer: the repeats' steps spread (single")
    assert "ddp:2" not in notes[1]


# --- progress ---------------------------------------------------------------------------------------------------------


def _lines_through(stream_fd: int, read_fd: int, phases: list[str]) -> str:
    with os.fdopen(stream_fd, "w") as stream:
        progress = PhaseProgress(phases, stream=stream)
        progress.start(phases[0])
        progress.drop(phases[2])
        progress.start(phases[1])
        progress.done()
    chunks = []
    try:
        while select.select([read_fd], [], [], 0)[0] and (chunk := os.read(read_fd, 4096)):
            chunks.append(chunk)
    except OSError:  # a pty whose terminal side closed: everything written was read
        pass
    os.close(read_fd)
    return b"".join(chunks).decode()


def test_progress_through_a_pipe_is_one_line_per_phase():
    read_fd, write_fd = os.pipe()
    text = _lines_through(write_fd, read_fd, ["measuring single", "measuring ddp:2", "fitting"])
    lines = text.splitlines()
    assert lines[0].startswith("plan: measuring single (1 of 3, ") and lines[0].endswith(" s so far)...")
    assert lines[1].startswith("plan: measuring ddp:2 (2 of 2, ")  # the dropped phase is no longer counted
    assert lines[2].startswith("plan: done in ") and len(lines) == 3 and "\r" not in text


def test_progress_on_a_terminal_updates_one_line_in_place():
    main_fd, tty_fd = pty.openpty()
    text = _lines_through(tty_fd, main_fd, ["measuring single", "measuring ddp:2", "fitting"])
    updates = text.replace("\r\n", "\n")  # the terminal turns the last newline into CR LF
    assert updates.count("\r") == 3 and updates.endswith("\n")  # three updates of one line, then the line kept
    assert "plan: measuring single (1 of 3" in text and "plan: done in " in text


def test_quiet_progress_writes_nothing():
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as stream:
        progress = PhaseProgress(["a"], enabled=False, stream=stream)
        progress.start("a")
        progress.done()
    assert os.read(read_fd, 100) == b""
    os.close(read_fd)
