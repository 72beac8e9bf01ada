"""One path, one checkpoint (issue 50): the path given is the path written under every strategy, a save replaces an
older checkpoint of the other form there, and the whole training state (a schedule, the gradient scaler, plain
values) comes back in place under any strategy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint_paths
from paratrain.checkpoint.file import load_checkpoint, save_checkpoint
from paratrain.checkpoint.location import check_target, locate, publish, replaced_path
from paratrain.checkpoint.sharded import is_sharded_checkpoint
from paratrain.errors import CheckpointError
from processes import run_ranks


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("one-path")
    return run_ranks(checkpoint_paths.pairs, 2, directory, str(directory / "checkpoints"), timeout=600)[0]


@pytest.mark.processes
@pytest.mark.parametrize(
    "pair", [f"{a}->{b}" for a in checkpoint_paths.STRATEGIES for b in checkpoint_paths.STRATEGIES if a != b]
)
def test_a_save_over_the_other_form_loads_under_every_strategy(pairs, pair):
    first, then = pair.split("->")
    r = pairs[pair]
    written = "file" if first in checkpoint_paths.FILE_FORM else "dir"
    assert r["older_form"] != written and r["form"] == written, r  # the save replaced the other form at that path
    assert r["step"] == 2 and r["rest"] == [], r  # the plain value came back into the state, nothing else was left
    assert r["schedule"] == r["saved"], r  # the LR schedule and the scaler's scale, exactly as saved
    assert r["leftovers"] == [], r  # no partial or replaced checkpoint left beside it
    if "single" in (first, then):  # one device against two ranks: float32 summation order
        assert r["max_diff"] < 1e-4, r  # AdamW normalises its updates: last-bit differences grow to ~1e-5
    else:
        assert r["bitwise"], r


def _state(step: int) -> dict:
    return {"weights": torch.full((3,), float(step)), "step": step}


def test_a_file_replaces_a_sharded_checkpoint_at_the_same_path(tmp_path):
    path = tmp_path / "ck.pt"
    path.mkdir()
    save_checkpoint({"step": 0}, path, "index.pt")  # a sharded checkpoint's shape: a directory with an index
    assert is_sharded_checkpoint(path)
    save_checkpoint(_state(1), tmp_path, "ck.pt")
    assert path.is_file() and load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


def test_a_crash_between_the_renames_leaves_the_old_checkpoint_found(tmp_path):
    path = tmp_path / "ck.pt"
    save_checkpoint(_state(0), tmp_path, "ck.pt")
    os.replace(path, replaced_path(path))  # what publish() did just before the process died
    found = locate(path)
    assert found.path == replaced_path(path) and not found.sharded
    assert load_checkpoint(found.path)["step"] == 0


def test_both_forms_at_one_path_are_refused_naming_both(tmp_path):
    save_checkpoint(_state(0), tmp_path, "ck.pt")
    legacy = tmp_path / "ck"  # an earlier paratrain's sharded checkpoint for ck.pt
    legacy.mkdir()
    save_checkpoint({"step": 1}, legacy, "index.pt")
    with pytest.raises(CheckpointError, match=r"ck\.pt holds two checkpoints: the file .*ck\.pt and the sharded .*ck/"):
        locate(tmp_path / "ck.pt")


def test_bad_paths_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"its directory .*missing does not exist; create the directory first"):
        check_target(tmp_path / "missing" / "ck.pt")
    mine = tmp_path / "mine.pt"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"a directory is there that is not a paratrain checkpoint.*notes\.txt"):
        check_target(mine)
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        locate(tmp_path / "nothing.pt")


def test_publish_replaces_a_directory_by_a_file_and_back(tmp_path):
    final = tmp_path / "ck.pt"
    final.write_bytes(b"old file")
    new_dir = tmp_path / ".ck.pt.partial"
    new_dir.mkdir()
    (new_dir / "index.pt").write_bytes(b"x")
    publish(new_dir, final)
    assert final.is_dir() and (final / "index.pt").read_bytes() == b"x"
    new_file = tmp_path / ".ck.pt.file"
    new_file.write_bytes(b"new file")
    publish(new_file, final)
    assert final.read_bytes() == b"new file" and sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


_KILLED_SAVE = """
import sys, torch
from pathlib import Path
from paratrain.checkpoint.file import save_checkpoint
from paratrain.checkpoint.sharded import LocalSlices, save_sharded
directory = Path(sys.argv[1])
save_checkpoint({"step": 0, "weights": torch.zeros(4)}, directory, "ck.pt")
big = torch.randn(64 * 2**20)  # 256 MiB: its write is under way when the test kills this process
print("saving", flush=True)
save_sharded({"weights": LocalSlices((big.numel(),), big.dtype, [(0, big)]), "step": 1}, directory, "ck.pt",
             rank=0, world_size=1, barrier=lambda: None)
"""


@pytest.mark.processes
def test_a_sharded_save_killed_half_way_over_a_file_leaves_the_file_loadable(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "saving", child.stderr.read() if child.stderr else ""
    partial = tmp_path / ".ck.pt.partial"
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".shard-00000.pt") for p in (partial.iterdir() if partial.is_dir() else [])):
        assert child.poll() is None, "the save finished before it could be killed: make the state larger"
        assert time.monotonic() < deadline, "the shard's write never started"
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    found = locate(tmp_path / "ck.pt")
    assert found.path == tmp_path / "ck.pt" and not found.sharded
    assert load_checkpoint(found.path)["step"] == 0
