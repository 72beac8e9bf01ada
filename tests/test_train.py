"""The training job end to end: the tutorial's result, determinism, strategies agreeing, checkpoints that survive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_main
from paratrain.checkpoint.file import latest_checkpoint, list_checkpoints, load_checkpoint
from paratrain.errors import CheckpointError, ConfigError
from paratrain.training import TrainConfig, train
from processes import run_cli, start_cli


def _config(**kwargs) -> TrainConfig:
    return TrainConfig(quiet=True, **kwargs)


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    """The tutorial's job, once, with checkpoints kept for the tests that compare against it."""
    directory = tmp_path_factory.mktemp("seed-run")
    result = train(_config(checkpoint_dir=str(directory), keep_checkpoints=10))
    return result, directory


def test_the_seed_job_reaches_about_89_percent(seed_run):
    result, _ = seed_run
    assert 0.85 <= result.test_accuracy <= 0.93
    assert result.epochs == 5 and result.strategy == "single" and result.devices == ["cpu"]
    assert result.steps == 5 * 23  # 1437 samples in batches of 64
    assert result.train_loss < result.epoch_losses[0]


@pytest.mark.slow
def test_same_seed_same_fingerprint(seed_run):
    again = train(_config())
    assert again.model_fingerprint == seed_run[0].model_fingerprint
    other = train(_config(seed=1))
    assert other.model_fingerprint != seed_run[0].model_fingerprint


def test_dp_on_three_cpu_replicas_matches_single(seed_run, tmp_path):
    result, single_dir = seed_run
    dp = train(_config(strategy="dp", devices="cpu,cpu,cpu", checkpoint_dir=str(tmp_path)))
    assert dp.strategy == "dp" and dp.devices == ["cpu", "cpu", "cpu"]
    assert dp.test_accuracy == result.test_accuracy
    a = load_checkpoint(latest_checkpoint(single_dir))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path))["model"]
    assert list(a) == list(b)  # no "module." prefix in either
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=0)


def test_checkpoints_every_epoch_are_plain_weights_only_dicts(seed_run):
    _, directory = seed_run
    paths = list_checkpoints(directory)
    assert len(paths) == 5
    state = torch.load(paths[-1], weights_only=True)
    assert state["epoch"] == 5 and state["batch"] == 0
    assert set(state["model"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert "state" in state["optimizer"] and "rng" in state


@pytest.mark.slow
def test_resume_mid_epoch_gives_the_uninterrupted_fingerprint(seed_run, tmp_path):
    first = train(_config(checkpoint_dir=str(tmp_path), checkpoint_every=7, max_steps=30))
    assert first.steps == 30
    latest = latest_checkpoint(tmp_path)
    state = load_checkpoint(latest)
    assert (state["epoch"], state["batch"]) == (1, 7)  # 23 steps per epoch: stopped at step 30
    resumed = train(_config(checkpoint_dir=str(tmp_path), resume="latest"))
    assert resumed.resumed_from == str(latest)
    assert resumed.steps == 5 * 23 - 30
    assert resumed.model_fingerprint == seed_run[0].model_fingerprint
    assert resumed.train_loss == pytest.approx(seed_run[0].train_loss, abs=1e-12)


@pytest.mark.processes
@pytest.mark.slow
def test_resume_after_a_killed_process(seed_run, tmp_path):
    """A real fault: SIGKILL the training process once it has written a mid-epoch checkpoint, then resume."""
    args = [
        "train",
        "--quiet",
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "3",
        "--keep-checkpoints",
        "50",
    ]
    proc = start_cli(*args)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list_checkpoints(tmp_path)) < 4 and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = list_checkpoints(tmp_path)
    assert written, proc.communicate()[1]
    result = run_cli(*args, "--resume", "--metrics-out", str(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["model_fingerprint"] == seed_run[0].model_fingerprint


def test_resume_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        train(_config(checkpoint_dir=str(tmp_path), resume="latest"))
    fresh = train(_config(checkpoint_dir=str(tmp_path), resume="if-exists", epochs=1))
    assert fresh.resumed_from is None
    # another model's run in the same directory
    with pytest.raises(ConfigError, match=r"cannot continue: --model: checkpoint 'simplenet', this run 'mlp'"):
        train(_config(checkpoint_dir=str(tmp_path), resume="latest", model="mlp", epochs=2))
    # a truncated checkpoint: an error naming it, never a silent start from scratch
    latest = latest_checkpoint(tmp_path)
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=latest.name):
        train(_config(checkpoint_dir=str(tmp_path), resume="latest", epochs=2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model": "resnet"}, r"unknown model 'resnet'; choose one of: simplenet, demo, mlp, cnn"),
        ({"dataset": "cifar"}, r"unknown dataset 'cifar'; choose one of: digits, digits60k, mnist, random"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"lr": 0.0}, "--lr must be positive"),
        ({"epochs": 0}, "--epochs must be at least 1"),
        ({"resume": "latest"}, "--resume needs --checkpoint-dir"),
        ({"model": "simplenet", "dataset": "random"}, "takes 784 inputs"),
        ({"strategy": "single", "devices": "cpu,cpu"}, "runs on one device but 2 were given"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        train(_config(**kwargs))


def test_other_models_and_the_random_dataset_train():
    demo = train(_config(model="demo", dataset="random", epochs=2, batch_size=30))
    assert 0.0 <= demo.test_accuracy <= 1.0 and demo.steps == 2 * 4
    mlp = train(_config(model="mlp", width=64, depth=1, epochs=1))
    cnn = train(_config(model="cnn", epochs=1, max_steps=5))
    assert mlp.steps == 23 and cnn.steps == 5


def _write_idx(path: Path, array: np.ndarray) -> None:
    magic = 0x00000803 if array.ndim == 3 else 0x00000801
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_from_idx_files_the_test_wrote(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 120), ("t10k", 40)):
        labels = rng.integers(0, 10, n)
        images = (rng.random((n, 28, 28)) * 50).astype(np.uint8)
        images[np.arange(n), labels, :] = 255  # a learnable stripe per class
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels)
    result = train(_config(dataset="mnist", data_dir=str(tmp_path), epochs=3, batch_size=16, lr=0.1, verify_data=False))
    assert result.steps == 3 * 8
    assert result.test_accuracy > 0.5


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("train", *args)


@pytest.mark.processes
@pytest.mark.slow
def test_cli_prints_the_seed_lines_and_writes_metrics(tmp_path):
    out = tmp_path / "metrics.json"
    result = _cli("--epochs", "2", "--log-every", "10", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("Epoch 0, Step 0, Loss: ") for line in lines)
    assert any(line.startswith("Epoch 1, Step 20, Loss: ") for line in lines)
    assert any(line.startswith("Epoch 1 done: train loss") for line in lines)
    assert lines[-1].startswith("Done: test accuracy")
    assert "Traceback" not in result.stderr and "epoch 1/2" not in result.stderr  # no bar: not a terminal
    metrics = json.loads(out.read_text())
    for key in (
        "test_accuracy",
        "train_loss",
        "epochs",
        "samples_per_second",
        "wall_seconds",
        "strategy",
        "devices",
        "seed",
        "model_fingerprint",
    ):
        assert key in metrics
    assert metrics["epochs"] == 2 and len(metrics["model_fingerprint"]) == 64


@pytest.mark.processes
@pytest.mark.slow
def test_cli_quiet_prints_only_the_result():
    result = _cli("--epochs", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().count("\n") == 0 and result.stdout.startswith("Done:")


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--model", "resnet"], 2, "unknown model 'resnet'; choose one of: simplenet, demo, mlp, cnn"),
        (["--batch-size", "0"], 2, "--batch-size must be at least 1; found 0"),
        (["--batch-size", "many"], 2, "--batch-size: expected an integer, found 'many'"),
        (["--lr", "-1"], 2, "--lr must be positive and below 3.4e+38; found -1.0"),
        (["--devices", "cuda:7"], 2, "cuda:7"),
        (["--devices", "cpu,cpu", "--strategy", "single"], 2, "runs on one device"),
        (["--resume"], 2, "--resume needs --checkpoint-dir"),
    ],
)
def test_cli_usage_errors_exit_2_without_traceback(capsys, args, code, message):
    found, _, err = run_main(capsys, "train", *args)
    assert found == code, err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.processes
@pytest.mark.slow
def test_cli_runtime_errors_exit_1(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _cli("--checkpoint-dir", str(blocker / "sub"), "--epochs", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr  # found before training: a usage error
    assert str(blocker / "sub") in result.stderr and "is a file" in result.stderr
    result = _cli("--checkpoint-dir", str(tmp_path / "empty"), "--resume")
    assert result.returncode == 1 and "no checkpoint in" in result.stderr


@pytest.mark.processes
@pytest.mark.skipif(os.environ.get("PARATRAIN_SKIP_EXAMPLES") == "1", reason="examples skipped on request")
@pytest.mark.parametrize(
    "script, extra", [("mnist_single.py", []), ("mnist_parallel.py", ["--strategy", "dp", "--devices", "cpu,cpu"])]
)
@pytest.mark.slow
def test_examples_run_on_tiny_settings(script, extra):
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "examples" / script), "--epochs", "1", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Epoch 0, Step 0, Loss: " in result.stdout
    assert "Test accuracy: " in result.stdout


def test_progress_bar_and_lines_go_through_the_log(capsys):
    lines: list[str] = []
    result = train(TrainConfig(epochs=1, progress_bar=True, log_every=10), log=lines.append)
    err = capsys.readouterr().err
    assert "Epoch 0" in err and "samples_per_s" in err  # the tqdm bar, on stderr, numbered as the lines are
    steps = [line.split(",")[1].strip() for line in lines if line.startswith("Epoch 0, Step ")]
    assert steps == ["Step 0", "Step 10", "Step 20"]
    assert lines[-1].startswith("Done: ") and result.steps == 23


def test_samples_per_second_counts_the_training_steps_only(tmp_path):
    result = train(_config(epochs=2, checkpoint_dir=str(tmp_path)))
    assert result.eval_seconds > 0 and result.checkpoint_seconds > 0 and result.train_seconds > 0
    assert result.samples_per_second == pytest.approx(result.samples / result.train_seconds)
    assert result.train_seconds + result.eval_seconds + result.checkpoint_seconds <= result.wall_seconds


# --- one run per checkpoint directory ----------------------------------------------------------------------------


def test_a_new_run_is_refused_a_directory_that_holds_another_runs_checkpoints(capsys, tmp_path):
    runs = tmp_path / "g"
    assert run_main(capsys, "train", "--epochs", "2", "--quiet", "--checkpoint-dir", str(runs))[0] == 0
    before = {p.name: p.stat().st_mtime_ns for p in runs.iterdir()}
    second = ("--epochs", "1", "--lr", "0.05", "--checkpoint-dir", str(runs), "--checkpoint-every", "5")
    code, out, err = run_main(capsys, "train", *second)
    assert code == 2 and "Epoch" not in out and err.count("\n") == 1, out + err
    assert f"--checkpoint-dir {runs} holds another run's checkpoints (2, the latest epoch-0002-step-000000.pt" in err
    assert "simplenet on digits, batch 64, seed 0, 2 epochs" in err  # which run it is
    assert "add --resume" in err and "give another --checkpoint-dir" in err
    assert {p.name: p.stat().st_mtime_ns for p in runs.iterdir()} == before  # nothing replaced, pruned or added
    # a resume with settings that cannot continue that run names each one
    code, _, err = run_main(capsys, "train", "--resume", "--batch-size", "32", "--seed", "3", *second)
    assert code == 2 and "--batch-size: checkpoint 64, this run 32; --seed: checkpoint 0, this run 3" in err
    assert {p.name: p.stat().st_mtime_ns for p in runs.iterdir()} == before


def test_resuming_a_complete_run_says_where_its_results_are_and_more_epochs_continue_it(capsys, tmp_path):
    runs, metrics = tmp_path / "g", tmp_path / "m.json"
    first = ("--quiet", "--checkpoint-dir", str(runs), "--metrics-out", str(metrics))
    assert run_main(capsys, "train", "--epochs", "2", *first)[0] == 0
    final = latest_checkpoint(runs)
    code, out, err = run_main(capsys, "train", "--epochs", "2", "--checkpoint-dir", str(runs), "--resume")
    assert code == 0 and err == "", err
    assert f"The run in {runs} is complete: it trained 2 of 2 epochs (test accuracy " in out
    assert f"Its final checkpoint is {final}; its metrics were written to {metrics}" in out
    assert "samples/s" not in out and "nan" not in out and "Epoch" not in out  # no summary of nothing
    # fewer epochs than it trained: complete as well, and said so
    code, out, _ = run_main(capsys, "train", "--epochs", "1", "--lr", "0.05", "--checkpoint-dir", str(runs), "--resume")
    assert code == 0 and "it trained 2 epochs, more than the 1 asked for" in out
    # more epochs continue it: one more epoch is trained
    more = tmp_path / "more.json"
    code, out, _ = run_main(
        capsys,
        "train",
        "--epochs",
        "3",
        "--quiet",
        "--checkpoint-dir",
        str(runs),
        "--resume",
        "--metrics-out",
        str(more),
    )
    assert code == 0 and json.loads(more.read_text())["steps"] == 23  # one epoch of digits in batches of 64
    assert (
        load_checkpoint(latest_checkpoint(runs))["run"]["epoch_test_accuracy"][:2]
        == json.loads(metrics.read_text())["epoch_test_accuracy"]
    )  # the run's history carries on in its checkpoints
