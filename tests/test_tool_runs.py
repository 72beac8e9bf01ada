"""How the tools run a configuration: a ddp rank gets every setting, and outputs are checked before any run."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_main
from paratrain.parallel import Parallel
from paratrain.tools import worker
from paratrain.tools.bench import BenchConfig
from paratrain.tools.runner import path_of
from processes import free_port


def report_precision(par: Parallel, settings: BenchConfig, extra: dict) -> dict:
    """A configuration's body that reports what its Parallel runs in."""
    return {"precision": par.precision.name, "timeout": par.strategy._timeout, "world_size": par.world_size}


def test_a_ddp_rank_runs_in_the_settings_precision_and_timeout(tmp_path, monkeypatch):
    """One rank of a ddp configuration, in this process at world size 1 (as torchrun would start it)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    settings = BenchConfig(precision="bf16-mixed", timeout=42.0)
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "run_in": path_of(report_precision),
                "settings_class": path_of(BenchConfig),
                "settings": settings.to_dict(),
                "extra": {},
                "out": str(tmp_path),
            }
        )
    )
    assert worker.main([str(job)]) == 0
    assert torch.load(tmp_path / "rank0.pt") == {"precision": "bf16-mixed", "timeout": 42.0, "world_size": 1}


@pytest.mark.parametrize("command", ["verify", "bench", "plan"])
def test_a_report_path_that_cannot_be_written_is_refused_before_any_run(capsys, tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, err = run_main(capsys, command, "--configs", "single", "--report-out", str(blocker / "r.json"))
    assert code == 2 and "--report-out" in err and "is a file" in err, err
    assert out == ""  # nothing ran


def test_bench_checks_its_markdown_path_before_any_run(capsys, tmp_path):
    code, out, err = run_main(capsys, "bench", "--configs", "single", "--markdown-out", str(tmp_path))
    assert code == 2 and "--markdown-out" in err and "is a directory" in err and out == ""
