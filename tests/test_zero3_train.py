"""`paratrain train --strategy zero3` end to end: the weights ddp ends with, bit for bit, and checkpoints both ways.

At two processes zero3's steps are ddp's bit for bit, so the runs' model fingerprints (sha256 over the final
state dict) must be equal; a zero3 checkpoint (every process's slices) resumes under ddp, and a ddp checkpoint
(one file) under zero3, each ending on the uninterrupted run's fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.checkpoint.sharded import is_sharded_checkpoint
from processes import finish, start_cli

pytestmark = [pytest.mark.processes, pytest.mark.slow]  # every test here starts processes; `make slow` runs them

FLAGS = ("--quiet", "--epochs", "1", "--optimizer", "adamw", "--lr", "0.001", "--nproc-per-node", "2")


def _train(directory: Path, strategy: str, *args: str) -> dict:
    out = directory / f"{strategy}.json"
    # one thread per worker: thread counts change float summation order
    proc = start_cli(
        "train", *FLAGS, "--strategy", strategy, "--metrics-out", str(out), *args, env={"OMP_NUM_THREADS": "1"}
    )
    finish(proc)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for strategy in ("zero3", "ddp"):
        directory = tmp_path_factory.mktemp(strategy)
        saved = ("--checkpoint-dir", str(directory / "ck"), "--checkpoint-every", "5", "--max-steps", "10")
        found[strategy] = (_train(directory, strategy, *saved), directory / "ck")
    return found


def test_zero3_ends_on_ddps_weights_and_writes_sharded_checkpoints(runs):
    (zero3, checkpoints), (ddp, _) = runs["zero3"], runs["ddp"]
    assert zero3["strategy"] == "zero3" and zero3["world_size"] == 2 and zero3["steps"] == 10
    assert zero3["model_fingerprint"] == ddp["model_fingerprint"]
    assert zero3["test_accuracy"] == ddp["test_accuracy"]
    step5 = checkpoints / "epoch-0000-step-000005.pt"  # a directory at the checkpoint's own name
    assert is_sharded_checkpoint(step5)
    assert sorted(f.name for f in step5.iterdir()) == ["index.pt", "shard-00000.pt", "shard-00001.pt"]


@pytest.mark.parametrize("source, strategy", [("zero3", "ddp"), ("ddp", "zero3")])
def test_a_checkpoint_resumes_under_the_other_strategy(runs, tmp_path, source, strategy):
    written = runs[source][1]
    path = written / "epoch-0000-step-000005.pt"  # a file (ddp) or a directory (zero3): the same name
    resumed = _train(
        tmp_path, strategy, "--resume", str(path), "--checkpoint-dir", str(tmp_path / "ck"), "--max-steps", "5"
    )
    assert resumed["resumed_from"] == str(path) and resumed["strategy"] == strategy
    assert resumed["model_fingerprint"] == runs[source][0]["model_fingerprint"]
