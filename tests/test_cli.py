"""The command line, run as users run it: a real subprocess through the installed entry points."""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from processes import run_cli as _run


@pytest.mark.processes
def test_env_reports_versions_and_backends():
    result = _run("env")
    assert result.returncode == 0, result.stderr
    for field in ("paratrain", "python", "torch", "gpus", "distributed", "gloo"):
        assert field in result.stdout
    report = json.loads(_run("env", "--json").stdout)
    assert report["backends"]["gloo"] is True
    assert isinstance(report["accelerators"], list)


@pytest.mark.processes
def test_demo_prints_the_seed_lines_for_three_cpu_replicas():
    result = _run("demo", "--devices", "cpu,cpu,cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    inside = [line for line in lines if "In Model" in line]
    assert inside.count("\tIn Model: input size torch.Size([10, 5]) output size torch.Size([10, 2])") == 9
    assert lines.count("Outside: input size torch.Size([30, 5]) output_size torch.Size([30, 2])") == 3
    assert "Batch 1: 30 samples split as [10, 10, 10] over cpu, cpu, cpu" in lines
    # the last batch of 100 is 10 samples: [4, 3, 3]
    assert "Batch 4: 10 samples split as [4, 3, 3] over cpu, cpu, cpu" in lines
    assert "Outside: input size torch.Size([10, 5]) output_size torch.Size([10, 2])" in lines


@pytest.mark.processes
def test_demo_defaults_to_two_cpu_replicas_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("default devices are the GPUs here")
    result = _run("demo", "--data-size", "30")
    assert result.returncode == 0, result.stderr
    assert "\tIn Model: input size torch.Size([15, 5]) output size torch.Size([15, 2])" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--devices", "banana"], "is not a device"),
        (["demo", "--devices", "cpu,,cpu"], "empty entry"),
        (["demo", "--batch-size", "0"], "--batch-size must be at least 1; found 0"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_without_traceback(capsys, args, message):
    code, _, err = run_main(capsys, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
