"""The log line every --log-every steps, and the same values in metrics.csv and the metrics file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_main
from paratrain.training.flops import peak_flops, step_flops
from paratrain.training.log_line import memory, peak_memory
from paratrain.training.logs import read_metrics

TINY = ("--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--log-every", "2")


def _run(capsys, tmp_path, *args: str) -> tuple[list[str], dict]:
    metrics = tmp_path / "m.json"
    code, out, err = run_main(capsys, "train", *TINY, "--metrics-out", str(metrics), *args)
    assert code == 0, err
    return [line for line in out.splitlines() if line.startswith("Epoch 0, Step ")], json.loads(metrics.read_text())


def test_the_line_says_loss_grad_norm_lr_speed_memory_and_flops(capsys, tmp_path):
    lines, result = _run(capsys, tmp_path, "--log-dir", str(tmp_path / "logs"), "--no-plot", "--no-tensorboard")
    assert [line.split(",")[1].strip() for line in lines] == ["Step 0", "Step 2", "Step 4"]
    parts = lines[1].split(" | ")
    assert parts[0].startswith("Epoch 0, Step 2, Loss: ")
    assert parts[1].startswith("grad_norm ") and parts[2] == "lr 0.01"
    assert parts[3].endswith(" samples/s") and parts[4].startswith("step ") and parts[4].endswith(" ms")
    assert parts[5].startswith("rss ") and parts[5].endswith(" MiB")  # a CPU run: the process's resident memory
    assert parts[6].endswith("FLOP/s") and "mfu" not in lines[1]  # no known peak on a CPU: no MFU, not a guess
    # the same values in the metrics file and in metrics.csv
    logged = result["logged_steps"]
    assert [entry["step"] for entry in logged] == [0, 2, 4]
    rows = read_metrics(tmp_path / "logs" / "metrics.csv")
    for entry in logged:
        at = {r["name"]: float(r["value"]) for r in rows if int(r["step"]) == entry["step"]}
        for name in ("train/grad_norm", "train/lr", "train/samples_per_s", "train/step_seconds", "memory/rss_mib"):
            assert at[name] == pytest.approx(entry[name], rel=1e-12), name
        assert at["train/flops_per_s"] == pytest.approx(entry["train/flops_per_s"], rel=1e-12)
    assert f"grad_norm {logged[1]['train/grad_norm']:.4g}" == parts[1]
    # SimpleNet's step on 32 samples: the linear layers' multiply-adds, forward and backward
    assert result["step_flops"] == 3 * 2 * 32 * (784 * 256 + 256 * 10)
    # the run's peak, one per process: at least every resident set it logged
    (peak,) = result["peak_memory_mib"]
    assert peak >= max(entry["memory/rss_mib"] for entry in logged)


def test_measuring_the_gradient_norm_changes_nothing_and_agrees_with_clipping(capsys, tmp_path):
    _, often = _run(capsys, tmp_path, "--log-every", "1", "--quiet")
    _, clipped = _run(capsys, tmp_path, "--log-every", "1", "--quiet", "--clip-grad-norm", "1e9")
    _, rarely = _run(capsys, tmp_path, "--log-every", "100", "--quiet")
    assert often["model_fingerprint"] == rarely["model_fingerprint"] == clipped["model_fingerprint"]
    norms = [entry["train/grad_norm"] for entry in often["logged_steps"]]
    assert norms == pytest.approx([entry["train/grad_norm"] for entry in clipped["logged_steps"]], rel=1e-6)
    assert len(norms) == 5 and len(rarely["logged_steps"]) == 1


def test_flops_of_a_linear_layer_and_no_peak_on_a_cpu():
    layer = nn.Linear(6, 3)
    assert step_flops(layer, torch.randn(4, 6)) == 3 * 2 * 4 * 6 * 3
    assert layer.training  # put back as it was
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None
    assert memory(torch.device("cpu"))["memory/rss_mib"] > 10


def test_peak_memory_is_the_resident_high_water_mark_even_after_the_memory_is_freed():
    clear_refs = Path("/proc/self/clear_refs")
    if not os.access(clear_refs, os.W_OK):
        pytest.skip("no /proc/self/clear_refs to reset the peak resident set (Linux 4.0 on)")
    clear_refs.write_text("5")  # VmHWM := the resident set now
    before = peak_memory(torch.device("cpu"))
    assert before is not None
    block = torch.ones(96 * 2**20 // 4)  # 96 MiB, every page touched
    del block
    after = peak_memory(torch.device("cpu"))
    assert after is not None and after >= before + 90
    assert memory(torch.device("cpu"))["memory/rss_mib"] < after - 60  # freed: the resident set fell, the peak did not
