"""Sharded checkpoints: written by N ranks, read by M, in one process (threads stand in for the ranks' writers).

The oracle is the whole state a single process would save: every world size that writes it and every world size
that reads it must see exactly that state, reading only the slices its pieces overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain.checkpoint.sharded as shard_checkpoint
from conftest import run_main
from paratrain.checkpoint.file import latest_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints
from paratrain.checkpoint.sharded import (
    Alias,
    LocalSlices,
    Owned,
    StoredTensor,
    is_sharded_checkpoint,
    materialize,
    open_sharded,
    read_plain,
    save_sharded,
)
from paratrain.ddp.buckets import Bucket
from paratrain.errors import CheckpointError, ConfigError
from paratrain.sharded.partition import shard_bucket
from sharded_states import save_in_threads

SHAPES = {"w": (5, 7), "b": (7,), "v": (3, 3, 2)}  # one bucket: w, b, v back to back


def _whole() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}
    model["running_mean"] = torch.arange(4.0)  # a buffer: rank 0's, whole
    state = {
        i: {"step": torch.tensor(float(3 + i)), "exp_avg": torch.randn(*shape, generator=g)}
        for i, shape in enumerate(SHAPES.values())
    }
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]},
        "epoch": 3,
        "rng": {"torch": torch.arange(10, dtype=torch.uint8), "python": (3, [1, 2], None)},
    }


def _bucket() -> Bucket:
    numels = [torch.Size(s).numel() for s in SHAPES.values()]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return Bucket(0, (0, 1, 2), tuple(offsets), sum(numels), torch.float32, torch.device("cpu"))


def _pieces(world: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, start, length) of each piece rank ``rank`` of ``world`` owns, as the zero strategies split them."""
    numels = [torch.Size(s).numel() for s in SHAPES.values()]
    names = list(SHAPES)
    shards = shard_bucket(_bucket(), numels, world, align=2)
    return [(names[p.param], p.start, p.length) for p in shards.pieces[rank]]


def _rank_state(whole: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` hands to save_sharded: its slices, its owned values, the plain rest."""
    mine = _pieces(world, rank)
    sliced = {id(whole["model"][name]): name for name in SHAPES}
    model: dict[str, Any] = {}
    for name, tensor in whole["model"].items():
        if name in SHAPES:
            slices = [(s, tensor.reshape(-1)[s : s + n]) for p, s, n in mine if p == name]
            model[name] = LocalSlices(tuple(tensor.shape), tensor.dtype, slices)
        elif id(tensor) in sliced:  # a tied weight: the tensor of another key
            model[name] = Alias(sliced[id(tensor)])
        else:
            model[name] = tensor
    state: dict[int, dict[str, Any]] = {}
    for i, name in enumerate(SHAPES):
        saved = whole["optimizer"]["state"][i]
        for p, start, n in mine:
            if p != name:
                continue
            entry = state.setdefault(i, {})
            entry["exp_avg"] = LocalSlices(
                tuple(saved["exp_avg"].shape), torch.float32, [(start, saved["exp_avg"].reshape(-1)[start : start + n])]
            )
            if start == 0:
                entry["step"] = Owned(saved["step"])
    return {**whole, "model": model, "optimizer": {**whole["optimizer"], "state": state}}


def _save_as(
    world: int, directory: Path, name: str, whole: dict[str, Any], fail: Callable[[int], None] | None = None
) -> Path:
    """Every rank of ``world`` saving in its own thread, meeting at a barrier as the ranks of a job do."""
    return save_in_threads(world, directory, name, lambda rank: _rank_state(whole, world, rank), fail)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("written_by", [1, 2, 3, 4])
def test_any_world_size_reads_back_exactly_the_state_of_one_process(tmp_path, written_by):
    whole = _whole()
    path = _save_as(written_by, tmp_path, "epoch-0003-step-000100", whole)
    assert is_sharded_checkpoint(path)
    assert sorted(f.name for f in path.iterdir()) == ["index.pt"] + [f"shard-{r:05d}.pt" for r in range(written_by)]
    assert _equal(materialize(open_sharded(path)), whole)


@pytest.mark.parametrize("written_by, read_by", [(4, 3), (4, 2), (2, 4), (3, 1), (1, 3)])
def test_a_rank_reads_only_the_slices_its_pieces_overlap(tmp_path, written_by, read_by):
    whole = _whole()
    path = _save_as(written_by, tmp_path, "ckpt", whole)
    written = {
        name: {(s, n) for r in range(written_by) for p, s, n in _pieces(written_by, r) if p == name} for name in SHAPES
    }
    for rank in range(read_by):
        stored = open_sharded(path)  # a fresh reader: what this rank alone touches
        reader = None
        for i, name in enumerate(SHAPES):
            for p, start, n in _pieces(read_by, rank):
                if p != name:
                    continue
                tensor = stored["optimizer"]["state"][i]["exp_avg"]
                assert isinstance(tensor, StoredTensor)
                expected = whole["optimizer"]["state"][i]["exp_avg"].reshape(-1)[start : start + n]
                assert torch.equal(tensor.read(start, n), expected)
                reader = tensor._reader
        assert reader is not None
        needed = sum(
            1
            for name in SHAPES
            for s, n in written[name]
            for p, start, length in _pieces(read_by, rank)
            if p == name and s < start + length and start < s + n
        )
        assert len(reader.verified) == needed < sum(len(v) for v in written.values()) + (read_by == 1)


@pytest.mark.parametrize("written_by", [1, 3])
def test_a_tied_weight_is_stored_once_and_both_keys_read_the_same_tensor(tmp_path, written_by):
    whole = _whole()
    whole["model"]["head"] = whole["model"]["w"]  # another module's name for the same weight
    path = _save_as(written_by, tmp_path, "ckpt", whole)
    index = load_checkpoint(path / "index.pt")
    entries = {tuple(e["path"]): e for e in index["tensors"]}
    assert ("model", "head") not in entries and entries[("model", "w")]["aliases"] == [("model", "head")]
    assert index["layout_version"] == 2  # readers before aliases refuse it, naming the upgrade
    stored = open_sharded(path)
    assert stored["model"]["head"] is stored["model"]["w"]
    read = materialize(stored)
    assert _equal(read, whole) and read["model"]["head"] is read["model"]["w"]  # tied again, as torch saves it


def test_a_checkpoint_without_aliases_keeps_the_first_layout_and_an_alias_must_name_slices(tmp_path):
    assert load_checkpoint(_save_as(2, tmp_path, "ckpt", _whole()) / "index.pt")["layout_version"] == 1
    broken = _rank_state(_whole(), 1, 0)
    broken["model"]["head"] = Alias("running_mean")  # a plain tensor, not a sliced one
    with pytest.raises(ConfigError, match="model/head is an alias of 'running_mean', which is no sliced tensor"):
        save_sharded(broken, tmp_path, "other", rank=0, world_size=1, barrier=lambda: None)


def test_a_changed_slice_or_a_cut_file_is_refused(tmp_path):
    path = _save_as(2, tmp_path, "ckpt", _whole())
    shard = path / "shard-00001.pt"
    values = torch.load(shard, weights_only=True)[0].numpy().tobytes()
    raw = bytearray(shard.read_bytes())
    at = raw.index(values)  # torch.save stores tensor bytes as they are
    raw[at] ^= 0xFF  # one byte flipped: the same size, other values
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"is damaged: a slice in shard-00001\.pt does not match its digest"):
        materialize(open_sharded(path))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"shard-00001\.pt is 100 bytes, the index says"):
        materialize(open_sharded(path))


def test_a_crash_mid_save_leaves_the_previous_checkpoint_the_latest(tmp_path, monkeypatch):
    whole = _whole()
    _save_as(2, tmp_path, "epoch-0000-step-000010", whole)

    def crash(partial: Path, final: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_checkpoint, "_publish", crash)
    with pytest.raises(OSError):
        _save_as(2, tmp_path, "epoch-0000-step-000020", whole)
    assert not (tmp_path / "epoch-0000-step-000020").exists()  # nothing half-written under the real name
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-0000-step-000010"
    assert _equal(materialize(read_plain(latest_checkpoint(tmp_path))), whole)
    monkeypatch.undo()
    _save_as(2, tmp_path, "epoch-0000-step-000020", whole)  # the next save cleans up what the crash left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0000-step-000010", "epoch-0000-step-000020"]


def test_a_rank_that_dies_before_writing_publishes_nothing(tmp_path):
    def die(rank: int) -> None:
        if rank == 1:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        _save_as(3, tmp_path, "ckpt", _whole(), fail=die)
    assert not (tmp_path / "ckpt").exists()


def test_slices_that_do_not_cover_a_tensor_are_refused(tmp_path):
    broken = _rank_state(_whole(), 1, 0)
    weight = broken["model"]["w"]
    broken["model"]["w"] = LocalSlices(weight.shape, weight.dtype, [*weight.slices, (0, weight.slices[0][1][:3])])
    with pytest.raises(CheckpointError, match="the ranks' slices of model/w overlap: nothing was published"):
        save_sharded(broken, tmp_path, "ckpt", rank=0, world_size=1, barrier=lambda: None)
    assert not (tmp_path / "ckpt").exists()


def test_saving_again_under_the_same_name_replaces_it(tmp_path):
    _save_as(3, tmp_path, "ckpt", _whole())
    other = _whole()
    other["epoch"] = 4
    _save_as(2, tmp_path, "ckpt", other)
    assert materialize(open_sharded(tmp_path / "ckpt"))["epoch"] == 4
    assert sorted(f.name for f in (tmp_path / "ckpt").iterdir()) == ["index.pt", "shard-00000.pt", "shard-00001.pt"]


def test_listing_pruning_and_loading_know_sharded_checkpoints(tmp_path):
    for step in (5, 10, 15):
        _save_as(2, tmp_path, f"epoch-0000-step-{step:06d}", _whole())
    (tmp_path / "epoch-0000-step-000020").mkdir()  # a directory without an index is no checkpoint
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"epoch-0000-step-{s:06d}" for s in (5, 10, 15)]
    prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["epoch-0000-step-000015"]
    with pytest.raises(CheckpointError, match=r"is a sharded checkpoint .*`paratrain checkpoint consolidate"):
        load_checkpoint(tmp_path / "epoch-0000-step-000015")


def test_consolidate_writes_the_state_one_process_saves(tmp_path):
    from paratrain.checkpoint.consolidate import consolidate

    whole = _whole()
    path = _save_as(3, tmp_path, "epoch-0003-step-000100", whole)
    written = consolidate(path, tmp_path / "model.pt")
    assert _equal(torch.load(tmp_path / "model.pt", weights_only=True), whole["model"]) and _equal(
        written, whole["model"]
    )
    consolidate(path, tmp_path / "all.pt", everything=True)
    assert _equal(torch.load(tmp_path / "all.pt", weights_only=True), whole)
    with pytest.raises(ConfigError, match=r"no checkpoint at .*missing: nothing is there"):
        consolidate(tmp_path / "missing", tmp_path / "x.pt")


def test_consolidate_takes_the_checkpoint_as_it_was_saved_or_trained_into(tmp_path, monkeypatch, capsys):
    """`paratrain checkpoint consolidate ckpt/zero2-final.pt` after an earlier paratrain's par.save(...,
    "ckpt/zero2-final.pt") wrote the directory ckpt/zero2-final/; a run's --checkpoint-dir gives its latest
    checkpoint, as --resume takes it."""
    monkeypatch.chdir(tmp_path)
    whole = _whole()
    _save_as(3, Path("ckpt"), "zero2-final", whole)
    for step in (5, 10):
        _save_as(2, Path("run"), f"epoch-0000-step-{step:06d}", {**whole, "epoch": step})
    code, out, err = run_main(capsys, "checkpoint", "consolidate", "ckpt/zero2-final.pt", "model.pt")
    assert code == 0 and err.splitlines() == [
        "paratrain checkpoint consolidate: ckpt/zero2-final.pt is the name the sharded checkpoint ckpt/zero2-final/ "
        "was saved under (an earlier paratrain wrote sharded checkpoints without .pt): reading it"
    ], err
    assert _equal(torch.load("model.pt", weights_only=True), whole["model"])
    assert out == "wrote model.pt (torch): the model state dict, 4 tensors, 64 elements\n"  # w 5x7, b 7, v 3x3x2, 4

    code, out, err = run_main(capsys, "checkpoint", "consolidate", "run", "all.pt", "--all")
    latest = Path("run", "epoch-0000-step-000010")
    assert code == 0 and err == (
        f"paratrain checkpoint consolidate: run is a run's checkpoint directory: reading its latest checkpoint, "
        f"{latest}\n"
    )
    assert torch.load("all.pt", weights_only=True)["epoch"] == 10
    # every tensor, nested ones too: 4 in the model, a step and an exp_avg per parameter, the torch RNG state
    tensors = 4 + 2 * len(SHAPES) + 1
    elements = 64 + len(SHAPES) + sum(torch.Size(s).numel() for s in SHAPES.values()) + 10
    assert out == (
        f"wrote all.pt (torch): the training state (model, optimizer, epoch, rng), {tensors} tensors, "
        f"{elements} elements\n"
    )

    # naming nothing is a usage error (2), saying what it takes; a directory of other things names what it holds
    code, _, err = run_main(capsys, "checkpoint", "consolidate", "missing.pt", "x.pt")
    assert code == 2 and err.startswith("paratrain checkpoint: error: no checkpoint at missing.pt: nothing is there;")
    assert "latest_checkpoint(" not in err
    code, _, err = run_main(capsys, "checkpoint", "consolidate", "ckpt", "x.pt")
    assert code == 2 and err.rstrip().endswith("it holds zero2-final/: give one"), err
    assert not Path("x.pt").exists()
