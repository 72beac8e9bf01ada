"""paratrain bench end to end on a tiny model: every configuration measured or skipped, the files it writes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.errors import ConfigError
from paratrain.tools import BenchConfig
from paratrain.tools.bench import PHASES, BenchReport, ConfigTiming, plotting_available
from paratrain.training.threads import available_cores
from processes import run_cli

pytestmark = pytest.mark.slow  # `make slow` (and CI) runs these; `make test` leaves them


GPU_DP = "dp:cuda:0,cuda:1"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = run_cli(
        "bench",
        *("--model", "mlp", "--width", "16", "--depth", "1", "--input-shape", "6", "--num-classes", "3"),
        *("--batch-size", "12", "--warmup", "1", "--steps", "3", "--repeats", "1"),
        *("--configs", "dp:cpu,cpu", "ddp:2", "zero2:2", GPU_DP, "--report-out", str(out)),
        env={"OMP_NUM_THREADS": "1"},
    )
    return result, out


@pytest.mark.processes
def test_every_configuration_is_measured_against_single(bench_run):
    result, out = bench_run
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    timings = {t["config"]: t for t in report["configs"]}
    assert list(timings)[:2] == ["single", "dp:cpu,cpu"]  # single added as the baseline
    assert any("single was added" in note for note in report["notes"])
    assert timings["single"]["speedup"] == 1.0 and timings["single"]["efficiency"] == 1.0
    assert isinstance(report["reliable"], bool) and report["machine"]["cores"] >= 1
    assert timings["single"]["threads_per_process"] == 1 and "threads" in result.stdout
    assert timings["zero2:2"]["status"] == "OK" and timings["zero2:2"]["devices"] == 2
    for word in ("single", "dp:cpu,cpu"):
        t = timings[word]
        assert t["status"] == "OK" and len(t["repeat_step_seconds"]) == 1
        assert set(t["phase_seconds"]) == set(PHASES) and all(v > 0 for v in t["phase_seconds"].values())
        assert t["samples_per_second"] == pytest.approx(12 / t["step_seconds"])
        assert t["efficiency"] == pytest.approx(t["speedup"] / t["devices"])
    if not torch.cuda.is_available():
        assert timings[GPU_DP]["status"] == "SKIPPED"
        assert "dp's CPU replicas are threads on the same" in result.stdout  # they add no compute: said so


@pytest.mark.processes
def test_markdown_and_plot_are_written_beside_the_json(bench_run):
    result, out = bench_run
    written = [str(out), str(out.with_suffix(".md"))] + ([str(out.with_suffix(".png"))] if plotting_available() else [])
    assert f"wrote {', '.join(written)}" in result.stdout  # every file, not only the JSON
    # the footnote gives each ddp configuration's threads, as a number
    assert "(ddp:2: 1 thread each, zero2:2: 1 thread each)" in result.stdout and "//" not in result.stdout
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("| configuration | devices | step ms |") and "| dp:cpu,cpu | 2 |" in markdown
    png = out.with_suffix(".png")
    if plotting_available():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "matplotlib is not installed" in out.read_text()


def _tiny_bench(bench_module, *, steps: int, repeats: int):
    """bench in this process on a tiny MLP: single and dp over two CPU replicas."""
    tiny = {"model": "mlp", "width": 8, "depth": 1, "input_shape": "6", "num_classes": 3, "batch_size": 8}
    return bench_module.bench(**tiny, warmup=0, steps=steps, repeats=repeats, configs=["single", "dp:cpu,cpu"])


def test_repeats_run_round_robin_and_report_medians(monkeypatch):
    bench_module = importlib.import_module("paratrain.tools.bench")

    order = []
    real = bench_module.run_config

    def recording(mode, settings, config, workdir, extra):
        order.append(config.word)
        return real(mode, settings, config, workdir, extra)

    monkeypatch.setattr(bench_module, "run_config", recording)
    report = _tiny_bench(bench_module, steps=3, repeats=3)
    assert order == ["single", "dp:cpu,cpu", "dp:cpu,cpu", "single", "single", "dp:cpu,cpu"]  # rotating
    for timing in report.timings:
        assert len(timing.repeat_step_seconds) == 3
        assert timing.step_seconds == sorted(timing.repeat_step_seconds)[1]


def test_a_plot_without_matplotlib_is_a_usage_error_before_running(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ConfigError, match=r"needs matplotlib.*paratrain\[plot\]"):
        BenchConfig(plot_out="x.png").check()


@pytest.mark.parametrize(
    "settings, message",
    [({"repeats": 0}, "--repeats"), ({"steps": 0}, "--steps"), ({"warmup": -1}, "--warmup")],
)
def test_bad_settings(settings, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**settings).check()


def test_each_configuration_computes_on_the_threads_train_would_give_it(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    report = _tiny_bench(importlib.import_module("paratrain.tools.bench"), steps=2, repeats=1)
    cores = available_cores()
    assert report.timing("single").threads_per_process == cores
    assert report.timing("dp:cpu,cpu").threads_per_process == max(1, cores // 2)  # the replicas share the cores
    assert torch.get_num_threads() == before  # put back afterwards
    machine = report.as_dict()["machine"]
    assert machine["cores"] >= 1 and set(machine) == {"cores", "load_average_before", "load_average_after"}


def _timing(config: str, devices: int, repeats: list[float], speedup: float) -> ConfigTiming:
    step = sorted(repeats)[len(repeats) // 2]
    timing = ConfigTiming(config, config.split(":")[0], devices, step_seconds=step, repeat_step_seconds=repeats)
    timing.speedup, timing.efficiency = speedup, speedup / devices
    timing.phase_seconds = dict.fromkeys(PHASES, step / 4)
    timing.judge()
    return timing


def test_an_impossible_efficiency_or_a_moving_median_is_marked_unreliable_in_the_table_and_the_json():
    believable = _timing("ddp:2", 2, [0.010, 0.011, 0.0105], 1.6)
    superlinear = _timing("ddp:4", 4, [0.010, 0.0101, 0.0102], 10.12 * 2)
    moving = _timing("zero1:2", 2, [0.010, 0.030, 0.012], 1.2)
    assert believable.unreliable == []
    assert superlinear.unreliable and "efficiency 506%" in superlinear.unreliable[0]
    assert moving.unreliable and "moved by 167% between repeats" in moving.unreliable[0]
    settings = {"repeats": 3, "steps": 5, "warmup": 1, "batch_size": 64}
    machine = {"cores": 2, "load_average_before": 3.0, "load_average_after": 4.5}
    report = BenchReport(settings, [believable, superlinear, moving], [], machine=machine)
    text = report.render()
    assert "506% unreliable" in text and "unreliable: ddp:4: efficiency 506%" in text
    assert "(load average 4.5 on 2 cores)" in text and "80%" in text and "80% unreliable" not in text
    data = report.as_dict()
    assert data["reliable"] is False and data["ok"] is True  # nothing failed; the figures are not to be trusted
    by_config = {c["config"]: c for c in data["configs"]}
    assert by_config["ddp:2"]["unreliable"] == [] and by_config["zero1:2"]["unreliable"]
    assert BenchReport(settings, [believable], [], machine=machine).reliable


ZERO_SPEED_MODES = (
    *("local", "torch-ddp", "fsdp2", "fsdp2-noreshard"),
    *("ddp", "zero1", "zero2", "zero3", "zero3-noreshard"),
)


@pytest.mark.processes
def test_zero_speed_quick_prints_every_mode_its_agreement_and_the_verdicts(tmp_path):
    """benchmarks/bench_zero_speed.py --quick on a small MLP (units of 65k+ parameters): about 15 s."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_zero_speed.py"
    src = str(Path(paratrain.__file__).resolve().parents[1])  # the child imports the same paratrain as this test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "zero_speed.json"
    command = [sys.executable, str(script), "--quick", "--width", "256", "--depth", "2", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    table = result.stdout.split("\nmode ", 1)[1].split("\n\n", 1)[0].splitlines()[2:]  # below the header's dashes
    rows = {line.split()[0]: line for line in table}
    for mode in ZERO_SPEED_MODES:  # each timed, or skipped with its reason: never missing, never a made-up figure
        assert mode in rows, result.stdout
        if mode in report["skipped"]:
            assert rows[mode].split()[1] == "skipped" and f"{mode} skipped: {report['skipped'][mode]}" in result.stdout
        else:
            assert float(rows[mode].split()[1]) > 0 and report["median_step_seconds"][mode] > 0
            if mode != "local":  # every data-parallel mode trains as torch's DDP does: bitwise at two ranks
                assert report["agreement"][mode]["bitwise"], report["agreement"][mode]
    assert not report["agreement"]["initial"]["bitwise"]  # the warm-up moved the weights: the check sees changes
    assert len(report["verdicts"]) == 4 and "zero3" in result.stdout.split("parameters after")[1]


def _run_benchmark(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / name
    src = str(Path(paratrain.__file__).resolve().parents[1])  # the child imports the same paratrain as this test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.processes
def test_zero_phases_quick_times_each_phase_and_an_all_gather_of_the_weights(tmp_path):
    """benchmarks/bench_zero_phases.py --quick: ddp's and zero1's phases, zero1's forward waiting for its gathers."""
    out = tmp_path / "phases.json"
    result = _run_benchmark("bench_zero_phases.py", "--quick", "--width", "256", "--depth", "2", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["phases"]["ddp"]["waiting"] == 0  # ddp's step leaves nothing in flight
    assert all(report["phases"][m]["total"] > 0 for m in ("ddp", "zero1"))
    assert report["gathers"]["all_gather_s"] > 0
    assert "gathered from two ranks by the sharded engines' gather" in result.stdout


@pytest.mark.processes
def test_step_skew_prints_the_median_and_the_mean_of_ddps_steps(tmp_path):
    out = tmp_path / "skew.json"
    result = _run_benchmark("bench_step_skew.py", "--models", "simplenet", "--steps", "20", "--out", str(out))
    found = json.loads(out.read_text())["models"]["simplenet"]
    assert found["steps"] == 20 and found["median_s"] > 0 and found["mean_s"] > 0
    assert "mean / median" in result.stdout


# --- plan's budget: fewer steps for a slow model, fewer repeats once they agree --------------------------------------

TINY = {"model": "mlp", "width": 16, "depth": 1, "input_shape": "6", "num_classes": 3, "batch_size": 12}


@pytest.mark.parametrize("word", ["single", pytest.param("ddp:2", marks=pytest.mark.processes)])
def test_a_budget_cuts_the_steps_to_the_fewest_and_the_ranks_agree(tmp_path, word):
    from paratrain.tools.bench import MIN_TIMED_STEPS, run_in
    from paratrain.tools.configs import parse_configs
    from paratrain.tools.runner import run_config

    settings = BenchConfig(**TINY, steps=10, warmup=3)
    (config,) = parse_configs([word])
    results = run_config(run_in, settings, config, tmp_path, {"timed_seconds": 1e-9})  # no step fits
    for result in results:  # every rank ran as many steps as the others
        assert result["steps"] == MIN_TIMED_STEPS and result["warmup"] == 1
        assert all(len(values) == MIN_TIMED_STEPS for values in result["phases"].values())
    (unlimited,) = run_config(run_in, settings, parse_configs(["single"])[0], tmp_path, {})
    assert unlimited["steps"] == 10 and unlimited["warmup"] == 3 and len(unlimited["phases"]["data"]) == 10


def test_repeats_stop_once_they_agree_when_asked_to_settle():
    from paratrain.tools.bench import time_configs
    from paratrain.tools.configs import parse_configs

    settings = BenchConfig(**TINY, steps=2, warmup=1, repeats=3, configs=["single"])
    (settled,) = time_configs(settings, parse_configs(["single"]), settle=100.0)  # any spread agrees
    assert len(settled.repeat_step_seconds) == 2
    (every,) = time_configs(settings, parse_configs(["single"]))
    assert len(every.repeat_step_seconds) == 3 and every.timed_steps == 2


@pytest.mark.processes
@pytest.mark.slow
def test_compile_quick_prints_every_strategy_eager_and_compiled_and_the_verdict(tmp_path):
    """benchmarks/bench_compile.py --quick on a small MLP: inductor compiles each strategy's model (slow: a C++
    build on a cold cache)."""
    out = tmp_path / "compile.json"
    result = _run_benchmark("bench_compile.py", "--quick", "--width", "256", "--depth", "2", "--out", str(out))
    report = json.loads(out.read_text())
    table = result.stdout.split("\nstrategy ", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in table}
    assert set(rows) == {"torch-ddp", "ddp", "zero1", "zero2", "zero3"}, result.stdout
    for strategy, cells in rows.items():  # timed both ways, or skipped with the reason printed
        for mode, cell in ((strategy, cells[1]), (f"{strategy}+compile", cells[2])):
            if mode in report["skipped"]:
                assert cell == "skipped" and f"{mode} skipped: " in result.stdout
            else:
                assert float(cell) > 0 and report["median_step_seconds"][mode] > 0
    assert report["verdict"]["line"] in result.stdout and "torch's DDP compiled" in report["verdict"]["line"]


@pytest.mark.processes
def test_train_memory_quick_reads_every_ranks_peak_from_the_metrics_file(tmp_path):
    """benchmarks/bench_train_memory.py --quick: paratrain train under zero2 and zero3, each rank's peak."""
    out = tmp_path / "train_memory.json"
    result = _run_benchmark("bench_train_memory.py", "--quick", "--strategies", "zero2", "zero3", "--out", str(out))
    report = json.loads(out.read_text())
    assert all(len(runs) == 1 and len(runs[0]) == 2 and min(runs[0]) > 100 for runs in report["peaks_mib"].values())
    assert len(report["zero3_below_zero2_mib"]) == 2 and report["formula_difference_mib"] > 0
    assert "zero3 below zero2 by" in result.stdout and ("PASS" in result.stdout or "FAIL" in result.stdout)


@pytest.mark.processes
def test_ddp_quick_times_ours_against_torchs_on_the_small_gpt(tmp_path):
    """benchmarks/bench_ddp.py --quick --model gpt: the step ratios to torch's DDP and the buckets' bandwidth."""
    out = tmp_path / "ddp_gpt.json"
    result = _run_benchmark("bench_ddp.py", "--quick", "--model", "gpt", "--threads", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["model"] == "gpt" and 3.6e6 < report["params"] < 3.8e6
    assert report["step_ratio_vs_torch"]["free_running"]["median"] > 0 and len(report["buckets"]) >= 1
    assert "paratrain / torch DDP step time" in result.stdout
