"""`paratrain train --strategy ddp` and the ddp example end to end: real torchrun, real processes, gloo."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint.file import latest_checkpoint, load_checkpoint
from paratrain.training import TrainConfig, train
from processes import cli_command, free_port, run_cli, start_cli
from processes import finish as _finish

pytestmark = pytest.mark.processes  # every test here starts processes

EPOCHS = "2"


def _train(*args: str, env: dict[str, str] | None = None):
    # one thread per worker whatever the node layout: thread counts change float summation order
    return start_cli("train", "--quiet", "--epochs", EPOCHS, *args, env={"OMP_NUM_THREADS": "1", **(env or {})})


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    result = train(TrainConfig(epochs=int(EPOCHS), quiet=True, checkpoint_dir=str(directory)))
    return result, load_checkpoint(latest_checkpoint(directory))["model"]


def _close_to_single(single, checkpoint_dir: Path, metrics: dict) -> None:
    result, params = single
    assert metrics["test_accuracy"] == result.test_accuracy
    mine = load_checkpoint(latest_checkpoint(checkpoint_dir))["model"]
    assert list(mine) == list(params)  # no "module." prefix
    for key in params:
        torch.testing.assert_close(mine[key], params[key], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ddp2")
    (directory / "tmp").mkdir()  # the job's temporary directory: a fresh one, to see what the job leaves there
    out = _finish(
        _train(
            "--strategy",
            "ddp",
            "--nproc-per-node",
            "2",
            "--checkpoint-dir",
            str(directory / "ckpt"),
            "--metrics-out",
            str(directory / "m.json"),
            env={"TMPDIR": str(directory / "tmp")},
        )
    )
    return directory, out


def test_ddp_two_processes_match_single(single, two_processes):
    directory, out = two_processes
    metrics = _metrics(directory / "m.json")
    assert metrics["strategy"] == "ddp" and metrics["world_size"] == 2 and metrics["devices"] == ["cpu", "cpu"]
    assert out.count("Done:") == 1  # only rank 0 prints
    _close_to_single(single, directory / "ckpt", metrics)


def test_a_clean_ddp_run_leaves_nothing_of_its_own_in_the_temporary_directory(two_processes):
    """The reported case: every rank left an empty paratrain-stacks-<pid>.txt in /tmp (173 after an hour of runs),
    and torchrun its torchelastic_* log directory. torch's compile cache, which torch keeps across runs on
    purpose (torchinductor_<user>, made when an optimizer is created: torch.optim imports torch._dynamo), is
    torch's, not the job's."""
    directory, _ = two_processes
    left = sorted(p.name for p in (directory / "tmp").iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], left


@pytest.mark.slow
def test_ddp_three_processes_resume_on_every_rank(single, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ("--strategy", "ddp", "--nproc-per-node", "3", "--checkpoint-dir", str(ckpt))
    _finish(_train(*common, "--checkpoint-every", "7", "--max-steps", "30"))
    state = load_checkpoint(latest_checkpoint(ckpt))
    assert (state["epoch"], state["batch"]) == (1, 7)
    _finish(_train(*common, "--resume", "--metrics-out", str(tmp_path / "resumed.json")))
    resumed = _metrics(tmp_path / "resumed.json")
    assert resumed["resumed_from"] and resumed["world_size"] == 3
    _close_to_single(single, ckpt, resumed)
    _finish(_train("--strategy", "ddp", "--nproc-per-node", "3", "--metrics-out", str(tmp_path / "full.json")))
    full = _metrics(tmp_path / "full.json")
    assert resumed["model_fingerprint"] == full["model_fingerprint"]
    # the resumed epoch's loss counts the steps before the checkpoint once, not once per process
    assert resumed["epoch_losses"][-1] == pytest.approx(full["epoch_losses"][-1], rel=1e-9)


@pytest.mark.slow
def test_two_node_agents_on_one_machine_equal_one_node(two_processes, tmp_path):
    port = str(free_port())
    nodes = [
        _train(
            "--strategy",
            "ddp",
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--metrics-out",
            str(tmp_path / f"m{rank}.json"),
        )
        for rank in (0, 1)
    ]
    for proc in nodes:
        _finish(proc)
    metrics = _metrics(tmp_path / "m0.json")
    assert not (tmp_path / "m1.json").exists()  # only global rank 0 writes
    assert metrics["world_size"] == 2
    one_node = _metrics(two_processes[0] / "m.json")
    assert metrics["model_fingerprint"] == one_node["model_fingerprint"]


@pytest.mark.slow
def test_parallel_example_through_the_launcher_is_ddp():
    root = Path(__file__).resolve().parents[1]
    result = run_cli("launch", "--nproc-per-node", "2", str(root / "examples" / "mnist_parallel.py"), "--epochs", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Test accuracy: ") == 1
    assert "ddp, 2 processes" in result.stdout
    # coming from torch's DDP, where a loader's batch is each process's: prepare says what it is here, once
    note = "paratrain: batch 64 is the global batch: 32 per process on 2 processes; for 64 per process give 128"
    assert result.stderr.count(note) == 1, result.stderr


@pytest.mark.slow
def test_the_logged_loss_is_the_global_batchs_and_the_threads_are_each_workers_share(tmp_path):
    """The tutorial's `Epoch E, Step S, Loss: L` line under ddp is the whole batch's loss, as on one device."""
    lines: list[str] = []
    train(TrainConfig(epochs=1, max_steps=1, log_every=1), log=lines.append)
    (single_line,) = [line for line in lines if line.startswith("Epoch 0, Step 0, Loss: ")]
    out = tmp_path / "m.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # unset, as a user leaves it
    args = ("train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "1", "--log-every", "1")
    result = subprocess.run([*cli_command(*args), "--metrics-out", str(out)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    (ddp_line,) = [line for line in result.stdout.splitlines() if line.startswith("Epoch 0, Step 0, Loss: ")]

    def loss(line: str) -> float:
        return float(line.split("Loss: ")[1].split(" | ")[0])

    assert loss(ddp_line) == pytest.approx(loss(single_line), rel=1e-6)
    assert "global batch 64 (32 per process)" in result.stdout
    metrics = _metrics(out)
    assert metrics["threads"] == max(1, (os.cpu_count() or 1) // 2)  # what the launcher gave each worker


@pytest.mark.parametrize(
    "args, message",
    [
        (("--model", "verify_models:raises"), "raised RuntimeError: cannot build this one"),
        (("--model", "verify_models:wrong_shape"), "expects 100 features per sample"),
        (("--dataset", "mnist", "--data-dir", "nodata"), "MNIST files missing from nodata"),
    ],
    ids=["broken-model", "wrong-shape", "no-mnist"],
)
@pytest.mark.slow
def test_a_ddp_runs_usage_error_is_one_line_from_the_launcher_as_without_ddp(args, message, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    alone = run_cli("train", *args, cwd=tmp_path, env=env)
    launched = run_cli("train", "--strategy", "ddp", "--nproc-per-node", "2", *args, cwd=tmp_path, env=env)
    assert launched.returncode == alone.returncode in (1, 2), launched.stderr
    assert launched.stderr == alone.stderr and launched.stderr.count("\n") == 1, launched.stderr
    assert message in launched.stderr and "Traceback" not in launched.stderr
    assert "rank" not in launched.stderr  # found before any rank started


def test_ddp_outside_a_launcher_says_how_to_start():
    from paratrain.errors import ConfigError

    with pytest.raises(ConfigError, match="paratrain launch --nproc-per-node N"):
        train(TrainConfig(strategy="ddp", quiet=True))


# --- resuming on another number of devices, or under another strategy ------------------------------------------


@pytest.fixture(scope="module")
def ddp2_checkpoints(tmp_path_factory):
    """Checkpoints written by ddp with 2 processes: at steps 7, 14, 21, the end of epoch 0, 28 (mid-epoch 1)."""
    directory = tmp_path_factory.mktemp("ddp2-ckpt")
    flags = ("--checkpoint-dir", str(directory), "--checkpoint-every", "7", "--keep-checkpoints", "20")
    _finish(_train("--strategy", "ddp", "--nproc-per-node", "2", *flags, "--max-steps", "29"))
    return directory


@pytest.mark.parametrize("where", ["epoch-0001-step-000000.pt", "epoch-0001-step-000005.pt"], ids=["boundary", "mid"])
@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu,cpu"), ("ddp", "3")])
@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_on_any_number_of_devices(
    single, ddp2_checkpoints, tmp_path, where, strategy, devices
):
    """Written by 2 processes; resumed on 1 device, 3 CPU replicas or 3 processes: the model of a run never stopped."""
    path, after = ddp2_checkpoints / where, tmp_path / "after"
    if strategy == "ddp":
        out = tmp_path / "m.json"
        resume = ("--resume", str(path), "--checkpoint-dir", str(after), "--metrics-out", str(out))
        _finish(_train("--strategy", "ddp", "--nproc-per-node", devices, *resume))
        metrics = _metrics(out)
    else:
        config = TrainConfig(
            epochs=int(EPOCHS),
            quiet=True,
            strategy=strategy,
            devices=devices,
            resume=str(path),
            checkpoint_dir=str(after),
        )
        metrics = train(config).as_dict()
    assert metrics["resumed_from"] == str(path)
    reference, params = single
    assert metrics["test_accuracy"] == reference.test_accuracy
    mine = load_checkpoint(latest_checkpoint(after))["model"]
    for key in params:
        torch.testing.assert_close(mine[key], params[key], atol=3e-8, rtol=0)


@pytest.mark.slow
def test_more_processes_than_samples_per_step_train_like_one_and_say_so_once(tmp_path):
    """Three processes with a global batch of 2: the third gets no samples each step. The run trains as one device
    does, and says so in one line at the start."""
    settings = {"epochs": 1, "model": "mlp", "width": 16, "depth": 1, "batch_size": 2, "max_steps": 2}
    train(TrainConfig(quiet=True, checkpoint_dir=str(tmp_path / "one"), **settings))
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    out, ckpt = tmp_path / "m.json", tmp_path / "three"
    args = ("--strategy", "ddp", "--nproc-per-node", "3", "--checkpoint-dir", str(ckpt), "--metrics-out", str(out))
    done = run_cli("train", "--quiet", *flags, *args, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    warning = (
        "paratrain train: warning: global batch 2 on 3 processes: 1 of them get no samples each step (they only wait "
        "for the others), and the batch keeps at most 2 processes busy: give --batch-size 3 or more, or start at most "
        "2 processes"
    )
    assert done.stderr.splitlines().count(warning) == 1, done.stderr
    metrics = _metrics(out)
    assert (metrics["world_size"], metrics["steps"], metrics["samples"]) == (3, 2, 4)
    one = load_checkpoint(latest_checkpoint(tmp_path / "one"))["model"]
    three = load_checkpoint(latest_checkpoint(ckpt))["model"]
    assert list(three) == list(one)
    for key in one:
        torch.testing.assert_close(three[key], one[key], atol=1e-6, rtol=0)
