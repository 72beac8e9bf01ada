"""The run record: the settings and environment every train run writes beside its outputs, and repeating a run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
import torch

from conftest import run_main
from paratrain.training import TrainConfig
from paratrain.training.run_record import RECORD_JSON, RECORD_TOML
from processes import run_cli

TINY = ("--epochs", "1", "--max-steps", "3", "--batch-size", "32", "--quiet", "--no-plot", "--no-tensorboard")


def test_a_run_records_its_settings_and_environment_beside_every_output(capsys, tmp_path):
    logs, checkpoints, metrics = tmp_path / "logs", tmp_path / "ckpt", tmp_path / "m.json"
    args = ("--log-dir", str(logs), "--checkpoint-dir", str(checkpoints), "--metrics-out", str(metrics), "--lr", "0.05")
    code, _, err = run_main(capsys, "train", *TINY, *args)
    assert code == 0, err
    result = json.loads(metrics.read_text())
    assert result["config"]["lr"] == 0.05 and result["config"]["max_steps"] == 3
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["world_size"] == 1 and env["devices"] == ["cpu"]
    assert env["strategy"] == "single" and env["backend"] is None and env["cuda"] == torch.version.cuda
    assert {"paratrain", "python"} <= env.keys()
    for directory in (logs, checkpoints):
        saved = tomllib.loads((directory / RECORD_TOML).read_text())
        assert saved["lr"] == 0.05 and saved["log-dir"] == str(logs)
        # the run's settings: this invocation's --max-steps is its own limit, kept in the JSON record only
        assert TrainConfig.from_file(directory / RECORD_TOML) == replace(
            TrainConfig.from_dict(result["config"]), max_steps=None
        )
        assert "max-steps" not in saved
        (invocation,) = json.loads((directory / RECORD_JSON).read_text())["invocations"]
        assert invocation["environment"] == env and invocation["resumed_from"] is None
    header = (logs / RECORD_TOML).read_text().splitlines()
    assert header[1] == (
        "# repeat it: paratrain train --config paratrain-run.toml --max-steps 3  "
        "(this invocation's limit, not the run's)"
    )
    assert header[2] == "# continue it: paratrain train --config paratrain-run.toml --resume"


def _repeat_command(record: Path) -> list[str]:
    """The header's "repeat it" command, as arguments after ``paratrain``."""
    line = next(line for line in record.read_text().splitlines() if line.startswith("# repeat it: paratrain "))
    command = line.removeprefix("# repeat it: paratrain ").split("  (")[0].split()
    return [str(record) if arg == RECORD_TOML else arg for arg in command]


def test_the_saved_file_repeats_the_run_to_the_same_fingerprint(capsys, tmp_path):
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    code, _, err = run_main(
        capsys, "train", *TINY, "--log-dir", str(tmp_path / "a"), "--metrics-out", str(first), "--optimizer", "adamw"
    )
    assert code == 0, err
    saved = tmp_path / "a" / RECORD_TOML
    code, _, err = run_main(
        capsys, *_repeat_command(saved), "--log-dir", str(tmp_path / "b"), "--metrics-out", str(again)
    )
    assert code == 0, err
    a, b = json.loads(first.read_text()), json.loads(again.read_text())
    assert b["steps"] == 3 and b["optimizer"] == "adamw"
    assert a["model_fingerprint"] == b["model_fingerprint"]
    # the same settings but the outputs named on the command line
    assert {k: v for k, v in a["config"].items() if k not in ("log_dir", "metrics_out")} == {
        k: v for k, v in b["config"].items() if k not in ("log_dir", "metrics_out")
    }


def test_a_resumed_run_records_its_resume(capsys, tmp_path):
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    common = (*TINY, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1")
    code, _, err = run_main(capsys, "train", *common, "--max-steps", "2")
    assert code == 0, err
    code, _, err = run_main(capsys, "train", *common, "--resume", "--metrics-out", str(metrics))
    assert code == 0, err
    fresh, resumed = json.loads((checkpoints / RECORD_JSON).read_text())["invocations"]
    assert fresh["resumed_from"] is None and fresh["start_step"] == 0
    assert resumed["resumed_from"] is not None and resumed["start_step"] == 2
    assert resumed["config"]["resume"] == "latest"
    assert json.loads(metrics.read_text())["start_step"] == 2
    assert "resumed from" in (checkpoints / RECORD_TOML).read_text().splitlines()[0]


def test_resuming_from_the_record_continues_the_whole_run(capsys, tmp_path):
    """`paratrain train --config DIR/paratrain-run.toml --resume` after a smoke run (--max-steps 14 of 3 epochs of
    12 steps): it trains to the run's end, not 14 steps more, and its metrics hold every epoch of the run, as the
    uninterrupted run's do."""
    common = ("--epochs", "3", "--batch-size", "128", "--model", "mlp", "--width", "16", "--depth", "1", "--quiet")
    common += ("--no-plot", "--no-tensorboard")
    checkpoints, resumed, full = tmp_path / "ckpt", tmp_path / "resumed.json", tmp_path / "full.json"
    code, _, err = run_main(capsys, "train", *common, "--checkpoint-dir", str(checkpoints), "--max-steps", "14")
    assert code == 0, err
    record = checkpoints / RECORD_TOML
    code, _, err = run_main(capsys, "train", "--config", str(record), "--resume", "--metrics-out", str(resumed))
    assert code == 0, err
    code, _, err = run_main(capsys, "train", *common, "--metrics-out", str(full))
    assert code == 0, err
    after, whole = json.loads(resumed.read_text()), json.loads(full.read_text())
    assert (after["start_step"], after["steps"], whole["steps"]) == (14, 36 - 14, 36)
    assert after["model_fingerprint"] == whole["model_fingerprint"]
    assert after["epoch_losses"] == whole["epoch_losses"] and len(whole["epoch_losses"]) == 3
    assert after["epoch_test_accuracy"] == whole["epoch_test_accuracy"]
    assert "max-steps" not in tomllib.loads(record.read_text())  # the resumed invocation's record, too


@pytest.mark.slow
@pytest.mark.processes
def test_a_ddp_run_records_its_processes_and_repeats_with_them(tmp_path):
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    args = ("--strategy", "ddp", "--nproc-per-node", "2", "--model", "mlp", "--width", "16", "--depth", "1")
    result = run_cli("train", *TINY, *args, "--log-dir", str(tmp_path / "a"), "--metrics-out", str(first))
    assert result.returncode == 0, result.stderr
    saved = tmp_path / "a" / RECORD_TOML
    text = saved.read_text()
    assert "# ddp on cpu, cpu (world size 2, backend gloo)" in text and "nproc-per-node = 2" in text
    result = run_cli(*_repeat_command(saved), "--log-dir", str(tmp_path / "b"), "--metrics-out", str(again))
    assert result.returncode == 0, result.stderr
    a, b = json.loads(first.read_text()), json.loads(again.read_text())
    assert b["world_size"] == 2 and b["environment"]["backend"] == "gloo"
    assert a["model_fingerprint"] == b["model_fingerprint"]
