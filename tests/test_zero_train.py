"""`paratrain train --strategy zero1/zero2` end to end, and checkpoints that resume on any number of devices.

A zero2 run on 3 processes stops at step 10 of an epoch of AdamW; its sharded checkpoint resumes as zero1 on 2
processes, and as single and dp in this process; a single-device checkpoint resumes as zero2 on 2; the
sharded checkpoint consolidates into a plain state dict that a plain model loads. (A zero2 checkpoint resuming
as ddp, bit for bit, is tests/test_zero.py's, in processes already running.)
Each ends where one device's uninterrupted run ends: its test accuracy, and its weights within float32 rounding
(AdamW's normalised steps carry the rounding of another summation order through the 13 steps after the resume;
measured at up to 2.7e-6 absolute on weights of about 1e-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint.file import latest_checkpoint
from paratrain.checkpoint.sharded import is_sharded_checkpoint, materialize, read_plain
from paratrain.training import TrainConfig, train
from paratrain.training.model_spec import build_model_spec
from processes import finish, start_cli

pytestmark = [pytest.mark.processes, pytest.mark.slow]  # every test here starts processes; `make slow` runs them

RUN = {"epochs": 1, "optimizer": "adamw", "lr": 1e-3, "quiet": True}
FLAGS = ("--quiet", "--epochs", "1", "--optimizer", "adamw", "--lr", "0.001")


def _train(*args: str):
    # one thread per worker: thread counts change float summation order
    return start_cli("train", *FLAGS, *args, env={"OMP_NUM_THREADS": "1"})


def _model(directory: Path) -> dict[str, torch.Tensor]:
    return materialize(read_plain(latest_checkpoint(directory)))["model"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    result = train(TrainConfig(checkpoint_dir=str(directory), checkpoint_every=5, keep_checkpoints=10, **RUN))
    return result, _model(directory), directory / "epoch-0000-step-000010.pt"


@pytest.fixture(scope="module")
def zero2_on_3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero2x3")
    args = ("--checkpoint-dir", str(directory), "--checkpoint-every", "5", "--max-steps", "10")
    finish(_train("--strategy", "zero2", "--nproc-per-node", "3", *args))
    return directory / "epoch-0000-step-000010.pt"


def _ends_like_single(single, metrics: dict, directory: Path) -> None:
    result, params, _ = single
    assert metrics["test_accuracy"] == result.test_accuracy
    mine = _model(directory)
    assert list(mine) == list(params)
    for key in params:
        torch.testing.assert_close(mine[key], params[key], atol=1e-5, rtol=0)


def test_the_zero2_checkpoint_is_every_ranks_slices(zero2_on_3):
    assert is_sharded_checkpoint(zero2_on_3)
    files = sorted(f.name for f in zero2_on_3.iterdir())
    assert files == ["index.pt", "shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    sizes = [(zero2_on_3 / f).stat().st_size for f in files[1:]]
    assert max(sizes) < 1.2 * min(sizes)  # balanced: each rank wrote a third of the weights and moments


@pytest.mark.parametrize(
    "strategy, processes, source",
    [("zero1", "2", "zero2"), ("zero2", "2", "single")],
    ids=["zero2x3-as-zero1x2", "single-as-zero2x2"],
)
@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_strategy_and_world_size(
    single, zero2_on_3, tmp_path, strategy, processes, source
):
    path = zero2_on_3 if source == "zero2" else single[2]
    out = tmp_path / "m.json"
    resume = ("--resume", str(path), "--checkpoint-dir", str(tmp_path / "after"), "--metrics-out", str(out))
    finish(_train("--strategy", strategy, "--nproc-per-node", processes, *resume))
    metrics = json.loads(out.read_text())
    assert metrics["resumed_from"] == str(path) and metrics["strategy"] == strategy
    assert metrics["world_size"] == int(processes)
    _ends_like_single(single, metrics, tmp_path / "after")
    assert is_sharded_checkpoint(latest_checkpoint(tmp_path / "after")) == strategy.startswith("zero")


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu,cpu")])
def test_a_zero2_checkpoint_resumes_in_one_process(single, zero2_on_3, tmp_path, strategy, devices):
    config = TrainConfig(
        strategy=strategy, devices=devices, resume=str(zero2_on_3), checkpoint_dir=str(tmp_path), **RUN
    )
    metrics = train(config).as_dict()
    assert metrics["resumed_from"] == str(zero2_on_3)
    _ends_like_single(single, metrics, tmp_path)


def test_consolidate_writes_the_model_as_a_plain_state_dict(single, zero2_on_3, tmp_path, capsys):
    from conftest import run_main

    out = tmp_path / "model.pt"
    code, printed, _ = run_main(capsys, "checkpoint", "consolidate", str(zero2_on_3), str(out))
    assert code == 0 and "the model state dict" in printed
    plain = torch.load(out, weights_only=True)
    assert plain.keys() == single[1].keys()
    model = materialize(read_plain(zero2_on_3))["model"]
    assert all(torch.equal(plain[k], model[k]) for k in plain)
    net = build_model_spec("simplenet", (1, 28, 28), 10, width=TrainConfig().width, depth=TrainConfig().depth)
    net.load_state_dict(plain)  # a plain model takes it as it is (strict)
