"""paratrain train's ways of training: accumulation, optimizers and schedules, precision, logs, users' models."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint.file import latest_checkpoint, list_checkpoints, load_checkpoint
from paratrain.cli import main
from paratrain.errors import ConfigError
from paratrain.parallel import seed_everything
from paratrain.training import TrainConfig, train
from paratrain.training.logs import read_metrics
from paratrain.training.models import build_model
from processes import finish, run_cli, start_cli

# a small job: 100 samples in global batches of 30, 30, 30 and 10, which every --accumulate below cuts unevenly
SMALL = {"dataset": "random", "model": "mlp", "width": 32, "depth": 1, "batch_size": 30, "lr": 0.1, "quiet": True}
SMALL_ARGS = ("--dataset", "random", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "30")


def _params(directory: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(directory))["model"]


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0)


@pytest.fixture(scope="module")
def one_step_per_batch(tmp_path_factory):
    directory = tmp_path_factory.mktemp("k1")
    train(TrainConfig(checkpoint_dir=str(directory), epochs=2, **SMALL))
    params = _params(directory)
    seed_everything(0)
    initial = build_model("mlp", (5,), 2, width=32, depth=1).state_dict()
    assert max((params[k] - initial[k]).abs().max().item() for k in params) > 1e-2  # it trained
    return params


@pytest.mark.parametrize(
    "strategy, devices, accumulate", [("single", "cpu", 4), ("single", "cpu", 3), ("dp", "cpu,cpu,cpu", 4)]
)
@pytest.mark.slow
def test_accumulation_trains_the_same_parameters(one_step_per_batch, tmp_path, strategy, devices, accumulate):
    config = TrainConfig(
        strategy=strategy, devices=devices, accumulate=accumulate, checkpoint_dir=str(tmp_path), epochs=2, **SMALL
    )
    result = train(config)
    assert result.accumulate == accumulate and result.steps == 2 * 4  # optimizer steps: one per global batch
    _assert_same_params(_params(tmp_path), one_step_per_batch)


def test_the_tutorials_job_accumulates_its_uneven_last_batch_exactly(tmp_path):
    """Digits: 22 batches of 64 (micro-batches 22, 21, 21) and one of 29 (10, 10, 9), against one step each."""
    train(TrainConfig(epochs=1, quiet=True, checkpoint_dir=str(tmp_path / "k1")))
    train(TrainConfig(epochs=1, quiet=True, accumulate=3, checkpoint_dir=str(tmp_path / "k3")))
    _assert_same_params(_params(tmp_path / "k3"), _params(tmp_path / "k1"))


# --- AdamW, a cosine schedule, clipping, 16-mixed and accumulation together: a resume stays exact ---------------

EVERYTHING = {
    **SMALL,
    "optimizer": "adamw",
    "lr": 0.01,
    "lr_schedule": "cosine",
    "warmup_steps": 3,
    "clip_grad_norm": 1.0,
    "precision": "16-mixed",
    "accumulate": 2,
    "epochs": 3,
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("everything")
    result = train(
        TrainConfig(checkpoint_dir=str(directory / "ckpt"), metrics_out=str(directory / "m.json"), **EVERYTHING)
    )
    return result, directory


def test_resume_with_schedule_scaler_and_adamw_is_exact(uninterrupted, tmp_path):
    full, directory = uninterrupted
    first = train(TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_every=3, max_steps=7, **EVERYTHING))
    assert first.steps == 7
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert (state["epoch"], state["batch"]) == (1, 3)  # 4 steps per epoch: stopped after step 7
    assert state["scheduler"]["last_epoch"] == 7 - first.skipped_steps  # one per applied optimizer step
    assert state["precision"]["name"] == "16-mixed" and "scale" in state["precision"]["scaler"]
    resumed = train(TrainConfig(checkpoint_dir=str(tmp_path), resume="latest", **EVERYTHING))
    assert resumed.model_fingerprint == full.model_fingerprint
    end = load_checkpoint(latest_checkpoint(tmp_path))
    assert (
        end["scheduler"]["_last_lr"] == load_checkpoint(latest_checkpoint(directory / "ckpt"))["scheduler"]["_last_lr"]
    )
    assert end["scheduler"]["_last_lr"][0] == pytest.approx(0.0, abs=1e-12)  # cosine reached its end: lr 0
    # another schedule cannot continue this run's: it would make the learning rate jump
    with pytest.raises(ConfigError, match=r"cannot continue: --warmup-steps: checkpoint 3, this run 9"):
        train(TrainConfig(checkpoint_dir=str(tmp_path), resume="latest", **{**EVERYTHING, "warmup_steps": 9}))
    with pytest.raises(ConfigError, match=r"cannot continue: --optimizer: checkpoint 'adamw', this run 'sgd'"):
        train(
            TrainConfig(checkpoint_dir=str(tmp_path), resume="latest", **{**EVERYTHING, "optimizer": "sgd", "lr": 0.1})
        )


def test_metrics_record_what_ran_per_epoch_and_where_the_time_went(uninterrupted):
    full, directory = uninterrupted
    metrics = json.loads((directory / "m.json").read_text())
    assert metrics["epoch_test_accuracy"] == full.epoch_test_accuracy and len(full.epoch_test_accuracy) == 3
    assert metrics["test_accuracy"] == metrics["epoch_test_accuracy"][-1]
    assert metrics["optimizer"] == "adamw" and metrics["lr_schedule"] == "cosine" and metrics["precision"] == "16-mixed"
    # torch's AdamW default, since none was asked for: the results say what was used
    assert metrics["optimizer_settings"] == {"lr": 0.01, "weight_decay": 0.01, "betas": [0.9, 0.999]}
    assert metrics["accumulate"] == 2 and metrics["clip_grad_norm"] == 1.0
    assert metrics["skipped_steps"] == full.skipped_steps >= 0
    breakdown = metrics["time_breakdown"]
    assert breakdown["clock"] == "host" and breakdown["phases"] == ["data", "forward", "backward", "optimizer", "rest"]
    (rank0,) = breakdown["ranks"]
    assert rank0["rank"] == 0 and rank0["steps"] == 3 * 4
    assert sum(rank0["shares"].values()) == pytest.approx(1.0)
    assert sum(rank0["seconds"].values()) == pytest.approx(rank0["step_seconds"])
    assert all(rank0["seconds"][phase] > 0 for phase in ("data", "forward", "backward", "optimizer"))


# --- --log-dir -----------------------------------------------------------------------------------------------


def test_log_dir_writes_the_series_from_the_main_process(tmp_path):
    pytest.importorskip("matplotlib", reason="curves.png needs the plot extra (pip install 'paratrain[plot]')")
    tensorboard = _has("tensorboard")
    logs = tmp_path / "logs"
    result = train(TrainConfig(epochs=2, log_every=2, log_dir=str(logs), tensorboard=tensorboard, **SMALL))
    rows = read_metrics(logs / "metrics.csv")
    names = {r["name"] for r in rows}
    assert names == {
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "train/skipped_steps",
        "epoch/train_loss",
        "epoch/test_accuracy",
    }
    logged = [(int(r["epoch"]), int(r["step"])) for r in rows if r["name"] == "train/loss"]
    assert logged == [(0, 0), (0, 2), (1, 4), (1, 6)]  # batches 0 and 2 of each 4-batch epoch, counted from 0
    accuracy = [float(r["value"]) for r in rows if r["name"] == "epoch/test_accuracy"]
    assert accuracy == result.epoch_test_accuracy
    assert (logs / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(logs))
        events.Reload()
        scalars = events.Scalars("epoch/test_accuracy")
        assert [e.step for e in scalars] == [3, 7]  # each epoch's last step
        assert [e.value for e in scalars] == pytest.approx(accuracy)  # TensorBoard stores float32
        assert len(list(logs.glob("events.out.tfevents.*"))) == 1


def test_a_resumed_run_continues_the_log_without_duplicates(tmp_path):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    common = {"log_dir": str(logs), "log_every": 1, "tensorboard": False, "plot": False, "checkpoint_dir": str(ckpt)}
    train(TrainConfig(epochs=2, checkpoint_every=3, max_steps=5, **common, **SMALL))
    # as after a crash: resume from step 3 although steps 4 and 5 (an epoch's end among them) were logged
    (at_step_3,) = [p for p in list_checkpoints(ckpt) if load_checkpoint(p)["global_step"] == 3]
    train(TrainConfig(epochs=2, resume=str(at_step_3), **common, **SMALL))
    rows = read_metrics(logs / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "train/loss"] == list(range(8))
    assert [int(r["step"]) for r in rows if r["name"] == "epoch/test_accuracy"] == [3, 7]


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize(
    "missing, flags, message",
    [
        (
            "tensorboard",
            ["--tensorboard"],
            "need the tensorboard package, not importable here: pip install 'paratrain[tensorboard]'",
        ),
        (
            "tensorboard",
            ["--log-with", "tensorboard"],
            "--log-with tensorboard asks for TensorBoard event files, which need the tensorboard package",
        ),
        (
            "matplotlib",
            ["--no-tensorboard", "--plot"],
            "need the matplotlib package, not importable here: pip install 'paratrain[plot]'",
        ),
    ],
)
def test_a_missing_extra_asked_for_is_a_usage_error_before_training(
    monkeypatch, capsys, tmp_path, missing, flags, message
):
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without the package looks like
    code = main(["train", "--quiet", "--log-dir", str(tmp_path / "logs"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert "(in a clone of paratrain: pip install -e '.[" in err  # for those who installed from a clone
    assert not (tmp_path / "logs").exists()  # nothing started


# what a Python without TensorBoard and matplotlib imports: None in sys.modules, so that find_spec finds nothing and
# an import fails, whatever this environment has installed
_WITHOUT_EXTRAS = "import sys\nfor name in ('tensorboard', 'matplotlib'):\n    sys.modules[name] = None\n"


@pytest.mark.processes
def test_log_dir_without_the_extras_writes_the_csv_and_says_once_what_they_add(tmp_path):
    """`paratrain train --log-dir runs/x` where neither extra is installed: metrics.csv, and one line."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_WITHOUT_EXTRAS)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    args = ("train", "--epochs", "1", "--max-steps", "2", "--quiet", "--log-every", "1", *SMALL_ARGS)
    done = run_cli(*args, "--log-dir", "runs/x", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "paratrain train: note: --log-dir runs/x gets metrics.csv only: pip install 'paratrain[tensorboard,plot]' "
        "(in a clone of paratrain: pip install -e '.[tensorboard,plot]') adds TensorBoard event files and curves.png "
        "(--no-tensorboard --no-plot: no note)"
    ]
    logs = tmp_path / "runs" / "x"
    assert sorted(p.name for p in logs.iterdir()) == ["metrics.csv", "paratrain-run.json", "paratrain-run.toml"]
    assert [int(r["step"]) for r in read_metrics(logs / "metrics.csv") if r["name"] == "train/loss"] == [0, 1]


def test_log_with_csv_and_tensorboard_are_what_log_dir_writes(monkeypatch, capsys, tmp_path):
    """The Accelerate habit: --log-with csv (tensorboard) names --log-dir's own files; without --log-dir it is one
    usage line, since there is no default directory to write into."""
    for package in ("tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, package, None)
    logs = tmp_path / "logs"
    code = main(["train", "--quiet", "--max-steps", "1", *SMALL_ARGS, "--log-dir", str(logs), "--log-with", "csv"])
    assert code == 0 and "gets metrics.csv only" in capsys.readouterr().err
    assert (logs / "metrics.csv").is_file()
    assert main(["train", "--quiet", "--log-with", "csv"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "paratrain train: error: --log-with csv writes into --log-dir, which has no default: add --log-dir DIR "
        "(runs/a, say)\n"
    )
    assert main(["train", "--log-dir", str(logs), "--log-with", "tensorboard", "--no-tensorboard"]) == 2
    assert (
        "--log-with tensorboard asks for TensorBoard event files, --no-tensorboard for none" in capsys.readouterr().err
    )


def test_without_extras_the_csv_is_still_written(monkeypatch, tmp_path):
    for package in ("tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, package, None)
    logs = tmp_path / "logs"
    train(TrainConfig(epochs=1, log_dir=str(logs), tensorboard=False, plot=False, **SMALL))
    assert sorted(p.name for p in logs.iterdir()) == ["metrics.csv", "paratrain-run.json", "paratrain-run.toml"]
    assert {r["name"] for r in read_metrics(logs / "metrics.csv")} >= {"train/loss", "epoch/test_accuracy"}


# --- bad input: one line, exit code 2, before anything runs -------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["--accumulate", "0"], "--accumulate must be at least 1"),
        (["--batch-size", "2", "--accumulate", "4"], "--accumulate 4 cuts each global batch into 4 micro-batches"),
        (["--clip-grad-norm", "-1"], "--clip-grad-norm must be positive; found -1.0"),
        (["--betas", "0.9"], "--betas: expected two numbers separated by a comma"),
        (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is for --optimizer sgd"),
        (["--betas", "0.8,0.99"], "--betas is for --optimizer adamw"),
        (["--warmup-steps", "-2"], "--warmup-steps must be 0 or more"),
        (["--tensorboard"], "--tensorboard writes into --log-dir; add --log-dir DIR"),
        (["--model", "no_such_module_here:build"], "--model no_such_module_here:build: cannot import"),
        (["--model", "resnet"], "unknown model 'resnet'; choose one of: simplenet, demo, mlp, cnn, or give your own"),
    ],
)
def test_bad_settings_exit_2_with_one_line(capsys, args, message):
    try:
        code = main(["train", "--quiet", *args])
    except SystemExit as exc:  # argparse's own errors (types, choices)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    # one line says it (argparse prints its usage above it)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("paratrain train: error: ")


def test_a_log_dir_that_is_a_file_is_refused(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["train", "--log-dir", str(blocker)]) == 2
    assert f"--log-dir {blocker} is a file" in capsys.readouterr().err


# --- --model module.path:callable ----------------------------------------------------------------------------


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    name = f"user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import math
            from torch import nn

            def two_args(input_shape, num_classes):
                return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

            def no_args():
                return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

            class Net(nn.Module):
                def __init__(self, input_shape, num_classes):
                    super().__init__()
                    self.fc = nn.Linear(math.prod(input_shape), num_classes)

                def forward(self, x):
                    return self.fc(x.flatten(1))

            def raises(input_shape, num_classes):
                raise ValueError(f"no model for {num_classes} classes")

            def not_a_module():
                return 42

            number = 3
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # the command imports from the current directory
    yield name
    sys.modules.pop(name, None)


def test_a_users_model_trains(user_models):
    for factory in ("two_args", "no_args", "Net"):
        result = train(TrainConfig(model=f"{user_models}:{factory}", epochs=1, max_steps=3, quiet=True))
        assert result.steps == 3 and result.model == f"{user_models}:{factory}"


@pytest.mark.parametrize(
    "factory, message",
    [
        ("raises", r"raises\(\(1, 28, 28\), 10\) raised ValueError: no model for 10 classes"),
        ("not_a_module", "returned a int, not a torch.nn.Module"),
        ("number", "'number' is a int, not a callable"),
        ("missing", "has no attribute 'missing'"),
    ],
)
def test_a_users_model_that_fails_says_which(user_models, factory, message):
    with pytest.raises(ConfigError, match=message):
        train(TrainConfig(model=f"{user_models}:{factory}", epochs=1, quiet=True))


# --- ddp end to end: accumulation over processes, and one logger, not one per rank --------------------------


@pytest.mark.processes
@pytest.mark.slow
def test_ddp_accumulates_like_one_device_and_only_rank_0_logs(one_step_per_batch, tmp_path):
    tensorboard = "--tensorboard" if _has("tensorboard") else "--no-tensorboard"
    plot = "--plot" if _has("matplotlib") else "--no-plot"
    proc = start_cli(
        *("train", "--quiet", "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "2", "--accumulate", "3"),
        *(*SMALL_ARGS, "--lr", "0.1", "--log-dir", str(tmp_path / "logs"), "--log-every", "2", tensorboard, plot),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "m.json")),
        env={"OMP_NUM_THREADS": "1"},
    )
    finish(proc)
    _assert_same_params(_params(tmp_path / "ckpt"), one_step_per_batch)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert [r["rank"] for r in metrics["time_breakdown"]["ranks"]] == [0, 1]  # rank 0's file holds both
    assert all(r["steps"] == 2 * 4 for r in metrics["time_breakdown"]["ranks"])
    assert len(metrics["peak_memory_mib"]) == 2 and all(peak > 0 for peak in metrics["peak_memory_mib"])
    assert len(metrics["epoch_test_accuracy"]) == 2
    rows = read_metrics(tmp_path / "logs" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["name"] == "train/loss"] == [0, 2, 4, 6]  # once each
    if tensorboard == "--tensorboard":
        assert len(list((tmp_path / "logs").glob("events.out.tfevents.*"))) == 1


def test_epochs_steps_and_accuracy_are_numbered_one_way_everywhere(capsys, tmp_path):
    """The console's `Epoch E, Step S` lines, the progress bar, metrics.csv and the metrics JSON agree."""
    logs, metrics = tmp_path / "logs", tmp_path / "m.json"
    logging = ("--log-dir", str(logs), "--no-tensorboard", "--no-plot", "--metrics-out", str(metrics))
    code = main(["train", *SMALL_ARGS, "--epochs", "2", "--log-every", "2", "--progress-bar", *logging])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    logged = [line.split(",")[:2] for line in captured.out.splitlines() if line.startswith("Epoch ") and "Step" in line]
    steps = [(int(e.split()[1]), int(s.split()[1])) for e, s in logged]
    assert steps == [(0, 0), (0, 2), (1, 0), (1, 2)]  # random data: 100 samples in 4 batches of up to 30
    assert "Epoch 0" in captured.err and "Epoch 1" in captured.err  # the bar, numbered as the lines are
    rows = read_metrics(logs / "metrics.csv")
    # the csv's step is the run's optimizer step (4 per epoch), its epoch the console's: in epoch 0 they coincide
    assert [(int(r["epoch"]), int(r["step"])) for r in rows if r["name"] == "train/loss"] == [
        (epoch, 4 * epoch + step) for epoch, step in steps
    ]
    result = json.loads(metrics.read_text())
    csv_accuracy = [float(r["value"]) for r in rows if r["name"] == "epoch/test_accuracy"]
    assert csv_accuracy == result["epoch_test_accuracy"]  # fractions in the files a program reads
    for epoch, accuracy in enumerate(result["epoch_test_accuracy"]):  # a percentage where a person reads it
        assert f"Epoch {epoch} done: train loss" in captured.out and f"test accuracy {accuracy:.2%}" in captured.out
    assert [int(r["epoch"]) for r in rows if r["name"] == "epoch/test_accuracy"] == [0, 1]
