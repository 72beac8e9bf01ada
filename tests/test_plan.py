"""paratrain plan end to end on a tiny model (measured here, all-reduce by real processes), and its checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.tools import PlanConfig, plan
from processes import run_cli

pytestmark = pytest.mark.slow  # `make slow` (and CI) runs these; `make test` leaves them


TINY = {"model": "mlp", "width": 16, "depth": 1, "input_shape": "6", "num_classes": 3, "batch_size": 12}


def _flags(settings: dict) -> list[str]:
    return [part for key, value in settings.items() for part in (f"--{key.replace('_', '-')}", str(value))]


@pytest.mark.processes
def test_plan_runs_what_it_can_extrapolates_the_rest_and_says_each_phase(tmp_path):
    """On this machine's cores (up to 2 here, --measure-up-to 2 elsewhere): single and ddp:2 run for real and are
    "measured"; 3 is "extrapolated" from the model fitted to them. stderr, a pipe here, has one line per phase."""
    out = tmp_path / "plan.json"
    result = run_cli(
        "plan",
        *_flags({**TINY, "max_world_size": 3, "measure_up_to": 2, "steps": 3, "warmup": 1, "report_out": out}),
        "--device-memory",
        "1GB",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["world_size"], r["source"]) for r in rows] == [(1, "measured"), (2, "measured"), (3, "extrapolated")]
    assert [r["per_device_batch"] for r in rows] == [12, 6, 4]
    assert rows[0]["speedup"] == 1.0
    for r in rows:
        assert r["step_seconds"] > 0 and r["samples_per_second"] == pytest.approx(12 / r["step_seconds"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["world_size"])
    inputs = report["inputs"]
    assert inputs["measured_world_sizes"] == [1, 2] and inputs["extrapolated_world_sizes"] == [3]
    for n in ("1", "2"):  # the real strategy's runs are the measured rows
        assert inputs["measured"][n]["status"] == "OK"
        assert rows[int(n) - 1]["step_seconds"] == inputs["measured"][n]["step_seconds"]
    assert rows[1]["fit_error"] == pytest.approx(0.0, abs=1e-9)  # one ddp size: the constant fits it exactly
    assert set(inputs["model_error_before_fit"]) == {"2"} and inputs["fit"]["points"] == 1
    assert {int(n) for n, _, _ in inputs["link_samples"]} == {2}  # all-reduces timed by 2 real processes
    assert inputs["local_link"]["bandwidth"] > 0
    # the table says which rows are which
    table = result.stdout.split("\n\n")[0].splitlines()
    assert "source" in table[0] and "fit error" in table[0]
    assert table[2].split()[-2] == "measured" and table[4].split()[-2:] == ["extrapolated", "-"]
    assert "a longer budget would" in result.stdout
    # progress: one line per phase on stderr (a pipe), numbered out of what is left, then the total
    progress = [line for line in result.stderr.splitlines() if line.startswith("plan: ")]
    assert progress[0].startswith("plan: running single (3 rounds at most) (1 of ")
    # one launch of ddp:2 for its rounds and the all-reduce timings
    ddp = "plan: running ddp:2 (3 rounds at most), then the all-reduce between its processes (2 of "
    assert sum(line.startswith("plan: running ddp:2") for line in progress) == 1
    assert any(line.startswith(ddp) for line in progress)
    assert any(line.startswith("plan: measuring compute on one device for world sizes 3 (") for line in progress)
    assert not any("measuring the all-reduce" in line for line in progress)
    last = progress[-2]
    assert last.startswith("plan: measuring memory (") and " of " in last
    count = last.split("(")[1].split(",")[0]
    assert count.split(" of ")[0] == count.split(" of ")[1]  # the last phase is n of n
    assert progress[-1].startswith("plan: done in ") and "\r" not in result.stderr
    if report["reliable"]:
        assert report["recommended_world_size"] in (1, 2, 3)
    else:  # a shared machine's load moved the tiny steps' medians: said, and no recommendation
        assert report["recommended_world_size"] is None and "no recommendation: " in result.stdout
    assert "assumptions:" in result.stdout and "recommendation:" in result.stdout
    assert any(a.startswith("extrapolated: world sizes 3 ") for a in report["assumptions"])
    # the memory per device of ddp, zero1, zero2 and zero3 at each N, and the fewest devices each fits on
    assert {(r["strategy"], r["world_size"]) for r in report["memory"]} == {
        (s, n) for s in ("ddp", "zero1", "zero2", "zero3") for n in (1, 2, 3)
    }
    assert report["fewest_devices"] == {"ddp": 1, "zero1": 1, "zero2": 1, "zero3": 1}  # a tiny model fits anywhere
    quiet = run_cli("plan", *_flags({**TINY, "max_world_size": 1, "steps": 2, "warmup": 1}), "--quiet")
    assert quiet.returncode == 0 and "plan: " not in quiet.stderr and "measured" in quiet.stdout


def test_several_machines_use_the_link_given_and_validation_compares_with_bench():
    # one device per machine: nothing to measure between processes here; the link is the user's
    report = plan(
        PlanConfig(
            **TINY,
            max_world_size=3,
            per_node=1,
            link_bandwidth=1.0,
            link_latency=1e-3,
            steps=3,
            warmup=1,
            validate=True,
            configs=["single"],
            repeats=1,
        )
    )
    two = report.row(2)
    (bucket,) = report.inputs["buckets_bytes"]  # a tiny model: one bucket
    assert two.comm_seconds == pytest.approx(1e-3 + bucket / 1e9)  # latency + ring factor 1 x bytes / 1 GB/s
    assert 0 < two.exposed_comm_seconds <= two.comm_seconds  # it starts before backward ends
    assert report.row(3).comm_seconds == pytest.approx(1e-3 + 4 / 3 * bucket / 1e9)
    assert report.inputs["remote_link"] == {"latency": 1e-3, "bandwidth": 1e9}
    assert report.inputs["link_samples"] == []
    (single,) = report.validation
    assert single["config"] == "single" and single["measured_seconds"] > 0
    assert single["error"] == pytest.approx(single["predicted_seconds"] / single["measured_seconds"] - 1)
    assert "validation against bench" in report.render()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_world_size": 4, "per_node": 2}, "span several machines"),
        ({"link_bandwidth": 1.0}, "go together"),
        ({"configs": ["dp:cpu,cpu"]}, "plan predicts ddp"),
        ({"min_efficiency": 0}, "--min-efficiency"),
        ({"max_world_size": 0}, "--max-world-size"),
    ],
)
def test_usage_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        plan(**{**TINY, **settings})


def test_slower_than_one_device_is_said():
    from paratrain.tools.plan import PlanReport
    from paratrain.tools.plan_model import ScalingRow

    rows = [ScalingRow(1, 64, 1.0, 64.0, 1.0, 1.0, 0.0, 0.0), ScalingRow(2, 32, 2.0, 32.0, 0.5, 0.25, 1.2, 1.3)]
    report = PlanReport({"min_efficiency": 0.7, "max_error": 0.15}, rows, 1, [], {})
    text = report.verdict()
    assert "stay on 1 device" in text and "2 devices: 0.50x" in text
    assert "with 2 devices a step is predicted SLOWER than on one device" in text


# --- measurements that cannot be trusted are said to be, and never recommend -----------------------------------------

SLEEPERS = {"input_shape": "6", "num_classes": 3, "batch_size": 12}


@pytest.mark.processes
def test_a_prediction_over_100_percent_efficiency_is_unreliable_not_a_recommendation(monkeypatch):
    """A step whose time grows faster than its batch (what a busy machine's spinning threads do to one device):
    two devices predicted more than twice as fast."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))  # the peers'
    report = plan(
        PlanConfig(model="verify_models:superlinear", **SLEEPERS, max_world_size=2, steps=4, warmup=1, repeats=2)
    )
    assert report.row(2).efficiency > 1.0
    assert not report.reliable and report.recommended is None
    assert any("more than 2 devices can be" in reason for reason in report.unreliable)
    text = report.render()
    assert "no recommendation: the measurements are unreliable: 2 devices are predicted" in text
    assert "run plan again on a quieter machine" in text and "recommendation: up to" not in text


def test_measurements_that_moved_between_repeats_are_found():
    from paratrain.tools.plan_measure import measure_profiles
    from paratrain.tools.settings import RunSettings
    from paratrain.tools.workload import Workload

    work = Workload.load(RunSettings(model="verify_models:slows_down", **SLEEPERS))
    _, moved = measure_profiles(work, torch.device("cpu"), [(12, 1)], steps=4, warmup=1, rounds=3)
    assert moved[(12, 1)] > 1.0  # quiet for the first round, busy after it


def test_unreliable_reasons_and_the_verdict_without_a_recommendation():
    from paratrain.tools.plan_model import ScalingRow
    from paratrain.tools.plan_report import PlanReport, unreliable_reasons

    rows = [ScalingRow(1, 64, 1.0, 64.0, 1.0, 1.0, 0.0, 0.0), ScalingRow(2, 32, 0.035, 1828.0, 28.31, 14.15, 0, 0)]
    reasons = unreliable_reasons(rows, {(64, 2): 0.3, (32, 1): 0.6})
    assert reasons == [
        "2 devices are predicted 28.31x faster than one (efficiency 1415%), more than 2 devices can be",
        "the step at batch 32 on 1 thread moved by 60% between repeats (more than 50%)",
    ]
    report = PlanReport({"min_efficiency": 0.7}, rows, None, [], {"load_average": 3.5, "cores": 2}, unreliable=reasons)
    assert report.verdict().startswith("no recommendation: the measurements are unreliable: 2 devices are")
    assert "(its load average is 3.5 on 2 cores)" in report.verdict()
    assert report.as_dict()["reliable"] is False and report.as_dict()["recommended_world_size"] is None
    assert unreliable_reasons(rows[:1], {(64, 2): 0.1}) == []


def test_one_run_per_size_takes_rounds_until_two_agree_each_a_second_of_tiny_steps_within_its_share():
    from paratrain.parallel import Parallel
    from paratrain.tools.plan_runs import bench_settings, run_real, run_rounds_in

    config = PlanConfig(**TINY, steps=3, warmup=1, repeats=3)
    (single,), link = run_real(config, [1], round_seconds=30.0, link_sizes=(4096,))
    assert link == []  # one process: no all-reduce to time
    assert single.status == "OK" and len(single.repeat_step_seconds) in (2, 3)
    assert single.timed_steps > 3  # a step of a fraction of a millisecond: more than --steps, a second's worth
    settings = bench_settings(config, ["single"])
    with Parallel("single", "cpu") as par:
        settled = run_rounds_in(par, settings, {"rounds": 3, "settle": 100.0, "timed_seconds": 0.05})
        every = run_rounds_in(par, settings, {"rounds": 3, "settle": 0.0, "timed_seconds": 0.05})
    assert len(settled["runs"]) == 2 and len(every["runs"]) == 3  # any spread agrees within 100x; none within 0
    assert all(run["warmup"] == 1 and len(run["phases"]["forward"]) == run["steps"] for run in settled["runs"])
