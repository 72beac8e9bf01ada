"""Checkpoints on real files: round trip, atomic replacement, and every way a file can be bad."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from paratrain.checkpoint import file as ckpt
from paratrain.checkpoint.file import (
    FORMAT,
    FORMAT_VERSION,
    check_writable,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from paratrain.checkpoint.rng import rng_state, set_rng_state
from paratrain.errors import CheckpointError, ConfigError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def make_model(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2))


def realistic_state() -> dict[str, Any]:
    """What a training loop saves: model, optimizer after a step (so momentum buffers exist), scalars, config, rng."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "step": 120,
        "best_loss": 0.25,
        "run_name": "mnist-dp",
        "config": {"lr": 0.1, "devices": [0, 1], "schedule": {"warmup": 5, "decay": (0.5, 10)}, "amp": False},
        "rng": rng_state(),
    }


def assert_same(a: Any, b: Any) -> None:
    """Deep equality where tensors compare by value, dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


class ExplodingTensor(torch.Tensor):
    """Passes the up-front type check (it is a tensor) but raises while torch.save pickles it: a mid-write crash."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("simulated crash while pickling")


# --- round trip ---------------------------------------------------------------------------------------------------


def test_round_trip_returns_what_was_saved(tmp_path: Path) -> None:
    state = realistic_state()
    path = save_checkpoint(state, tmp_path / "run", checkpoint_name(3, 120))
    assert path == tmp_path / "run" / "epoch-0003-step-000120.pt"
    assert leftovers(tmp_path / "run") == []
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    # the loaded optimizer state really goes back into an optimizer
    model = make_model()
    model.load_state_dict(loaded["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(loaded["optimizer"])


def test_file_loads_with_plain_weights_only_torch_load(tmp_path: Path) -> None:
    state = realistic_state()
    path = save_checkpoint(state, tmp_path, "c.pt")
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == FORMAT and raw["format_version"] == FORMAT_VERSION and len(raw["digest"]) == 64
    assert_same(state, {key: value for key, value in raw.items() if key not in ("format", "format_version", "digest")})


def test_overwrite_replaces_the_file(tmp_path: Path) -> None:
    save_checkpoint({"step": 1}, tmp_path, "last.pt")
    save_checkpoint({"step": 2}, tmp_path, "last.pt")
    assert load_checkpoint(tmp_path / "last.pt") == {"step": 2}
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"array": np.zeros(3)}, "state['array']"),
        ({"scale": np.float64(1.0)}, "state['scale']"),  # subclasses float, yet weights_only refuses it
        ({"config": {"items": [1, object()]}}, "state['config']['items'][1]"),
        ({"seen": frozenset({1})}, "state['seen']"),
    ],
)
def test_values_weights_only_refuses_are_rejected_before_writing(tmp_path: Path, state: Any, where: str) -> None:
    with pytest.raises(ConfigError, match=rf"{re.escape(where)} is a .*weights_only"):
        save_checkpoint(state, tmp_path, "c.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["", "..", "sub/c.pt", "/abs/c.pt"])
def test_name_must_be_a_plain_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="plain file name"):
        save_checkpoint({}, tmp_path, name)


def test_reserved_keys_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reserved"):
        save_checkpoint({"format": "mine"}, tmp_path, "c.pt")


# --- atomicity ----------------------------------------------------------------------------------------------------


def test_exception_mid_write_keeps_previous_file(tmp_path: Path) -> None:
    good = save_checkpoint({"step": 1, "w": torch.ones(3)}, tmp_path, "last.pt")
    before = good.read_bytes()
    bad = {"step": 2, "w": torch.zeros(3).as_subclass(ExplodingTensor)}
    with pytest.raises(
        CheckpointError, match=r"could not write checkpoint .*last\.pt.*simulated crash.*intact"
    ) as info:
        save_checkpoint(bad, tmp_path, "last.pt")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert good.read_bytes() == before
    assert_same(load_checkpoint(good), {"step": 1, "w": torch.ones(3)})
    assert leftovers(tmp_path) == []


def test_disk_full_mid_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = save_checkpoint({"step": 1}, tmp_path, "last.pt")
    seen_while_writing: list[str] = []

    def half_written_save(obj: Any, file: Any, **kwargs: Any) -> None:
        file.write(b"PK\x03\x04 partial")
        file.flush()
        seen_while_writing.extend(leftovers(tmp_path))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", half_written_save)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint({"step": 2}, tmp_path, "last.pt")
    assert len(seen_while_writing) == 1  # the partial data went to a temporary file, not to last.pt
    assert load_checkpoint(good) == {"step": 1}
    assert leftovers(tmp_path) == []


def test_directory_fsync_refusal_does_not_fail_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync
    refused: list[int] = []

    def fsync_files_only(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            refused.append(fd)
            raise OSError(22, "Invalid argument")  # what some network file systems answer
        real_fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to tell a directory descriptor from a file's")
    monkeypatch.setattr(ckpt.os, "fsync", fsync_files_only)
    path = save_checkpoint({"step": 1}, tmp_path, "c.pt")
    assert refused, "the directory was never fsynced, so this test proved nothing"
    assert load_checkpoint(path) == {"step": 1}


@pytest.mark.processes
def test_process_killed_mid_write_keeps_previous_file(tmp_path: Path) -> None:
    """A real crash: the process dies inside torch.save, so no cleanup runs at all."""
    good = save_checkpoint({"step": 1}, tmp_path, checkpoint_name(0, 1))
    script = textwrap.dedent(
        """
        import os, sys, torch
        from paratrain.checkpoint.file import save_checkpoint

        class Dying(torch.Tensor):
            def __reduce_ex__(self, protocol):
                os._exit(17)

        save_checkpoint({"w": torch.ones(2).as_subclass(Dying)}, sys.argv[1], sys.argv[2])
        """
    )
    # the child imports the same paratrain as this test, installed or not
    src = str(Path(ckpt.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", script, str(tmp_path), good.name]
    result = subprocess.run(command, capture_output=True, timeout=120, env=env)
    assert result.returncode == 17, result.stderr.decode()
    assert len(leftovers(tmp_path)) == 1  # the temporary file is left behind ...
    assert load_checkpoint(good) == {"step": 1}  # ... but the checkpoint is intact
    assert list_checkpoints(tmp_path) == [good]  # ... and the leftover is never taken for a checkpoint


# --- bad files ----------------------------------------------------------------------------------------------------


def test_truncated_file_names_file_and_previous_checkpoint(tmp_path: Path) -> None:
    previous = save_checkpoint(realistic_state(), tmp_path, checkpoint_name(1, 10))
    path = save_checkpoint(realistic_state(), tmp_path, checkpoint_name(2, 20))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "Delete it" in message and previous.name in message


def test_empty_file_is_reported_as_truncated(tmp_path: Path) -> None:
    path = tmp_path / checkpoint_name(0, 0)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is truncated"):
        load_checkpoint(path)


def test_random_bytes_are_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "noise.pt"
    path.write_bytes(bytes(random.Random(0).getrandbits(8) for _ in range(4096)))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is not a PyTorch checkpoint"):
        load_checkpoint(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} does not exist.*latest_checkpoint"):
        load_checkpoint(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


def test_file_with_objects_weights_only_refuses(tmp_path: Path) -> None:
    path = tmp_path / "pickled.pt"
    torch.save({"format": FORMAT, "format_version": 1, "array": np.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="weights-only loading refuses"):
        load_checkpoint(path)


def test_bare_state_dict_is_not_a_paratrain_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(make_model().state_dict(), path)
    with pytest.raises(CheckpointError, match=r"not a paratrain checkpoint.*'0\.weight'.*torch\.load"):
        load_checkpoint(path)


def test_non_dict_file(tmp_path: Path) -> None:
    path = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), path)
    with pytest.raises(CheckpointError, match="found a Tensor"):
        load_checkpoint(path)


def test_wrong_format_marker(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"format": "someone-else", "format_version": 1}, path)
    with pytest.raises(CheckpointError, match="someone-else"):
        load_checkpoint(path)


def test_future_format_version(tmp_path: Path) -> None:
    path = tmp_path / "future.pt"
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION + 1}, path)
    with pytest.raises(CheckpointError, match=r"newer paratrain.*Upgrade"):
        load_checkpoint(path)


def test_map_location_is_passed_through(tmp_path: Path) -> None:
    path = save_checkpoint({"w": torch.ones(2)}, tmp_path, "c.pt")
    assert load_checkpoint(path, map_location=torch.device("meta"))["w"].is_meta


# --- compatibility ------------------------------------------------------------------------------------------------


def test_check_writable_creates_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert check_writable(target) == target
    assert target.is_dir() and list(target.iterdir()) == []


@pytest.mark.skipif(IS_ROOT, reason="root ignores directory permissions")
def test_check_writable_read_only_directory(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match=rf"cannot write checkpoints to {re.escape(str(target))}: Permission"):
            check_writable(target)
    finally:
        target.chmod(0o700)


def test_check_writable_reports_the_os_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs even as root: the file system's refusal is simulated at the probe file."""

    def refuse(path: Any, *args: Any, **kwargs: Any) -> int:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckpt.os, "open", refuse)
    with pytest.raises(CheckpointError, match=rf"to {re.escape(str(tmp_path))}: Permission denied\. Choose"):
        check_writable(tmp_path)


def test_check_writable_parent_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoints to {re.escape(str(blocker / 'ckpt'))}: "):
        check_writable(blocker / "ckpt")


# --- listing and pruning ------------------------------------------------------------------------------------------


def make_run(directory: Path, points: list[tuple[int, int]]) -> list[Path]:
    for epoch, step in points:
        save_checkpoint({"epoch": epoch, "step": step}, directory, checkpoint_name(epoch, step))
    # unrelated files and a crash's leftover, which listing must ignore
    (directory / "notes.txt").write_text("hi")
    (directory / "epoch-0001-step-000001.pt.bak").write_text("old")
    (directory / ".epoch-0099-step-000999.pt.123-abcd.tmp").write_bytes(b"PK")
    (directory / "epoch-0050-step-000000.pt").mkdir()
    return [directory / checkpoint_name(epoch, step) for epoch, step in sorted(points)]


def test_checkpoint_name_sorts_like_epoch_and_step() -> None:
    assert checkpoint_name(3, 120) == "epoch-0003-step-000120.pt"
    with pytest.raises(ConfigError, match="non-negative"):
        checkpoint_name(-1, 0)


def test_list_and_latest_order_by_epoch_then_step(tmp_path: Path) -> None:
    # step 1_000_000 outgrows the zero padding; ordering still follows the numbers, not the text
    expected = make_run(tmp_path, [(2, 5), (0, 9), (10, 1), (2, 1_000_000), (2, 40)])
    assert list_checkpoints(tmp_path) == expected
    assert latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(10, 1)


def test_empty_or_missing_directory_has_no_checkpoints(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "missing") == []
    assert latest_checkpoint(tmp_path) is None


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    paths = make_run(tmp_path, [(0, 1), (0, 2), (1, 1), (1, 2)])
    assert prune_checkpoints(tmp_path, keep=2) == paths[:2]
    assert list_checkpoints(tmp_path) == paths[2:]
    assert (tmp_path / "notes.txt").exists()
    assert prune_checkpoints(tmp_path, keep=5) == []
    with pytest.raises(ConfigError, match="keep must be"):
        prune_checkpoints(tmp_path, keep=0)


# --- random number generators -------------------------------------------------------------------------------------


def test_rng_round_trip_through_a_file_is_exact(tmp_path: Path) -> None:
    random.seed(7)
    random.gauss(0, 1)  # leaves a cached gauss_next, which is part of the state
    path = save_checkpoint({"rng": rng_state()}, tmp_path, "c.pt")
    expected = (torch.rand(5), [random.random() for _ in range(5)], random.gauss(0, 1))
    torch.manual_seed(999)
    random.seed(999)
    set_rng_state(load_checkpoint(path)["rng"])
    assert_same((torch.rand(5), [random.random() for _ in range(5)], random.gauss(0, 1)), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip_is_exact(tmp_path: Path) -> None:
    path = save_checkpoint({"rng": rng_state()}, tmp_path, "c.pt")
    expected = [torch.rand(3, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed_all(999)
    set_rng_state(load_checkpoint(path)["rng"])
    assert_same([torch.rand(3, device=f"cuda:{i}").cpu() for i in range(torch.cuda.device_count())], expected)


def test_different_cuda_device_count_warns_and_restores_the_rest() -> None:
    state = rng_state()
    available = len(state["cuda"])
    state["cuda"] = state["cuda"] + [torch.get_rng_state()]  # pretend the saving machine had one more device
    expected = torch.rand(3)
    torch.manual_seed(999)
    with pytest.warns(RuntimeWarning, match=rf"holds {available + 1} CUDA generator\(s\) but this machine has"):
        set_rng_state(state)
    assert_same(torch.rand(3), expected)


def test_set_rng_state_rejects_something_else() -> None:
    with pytest.raises(CheckpointError, match="rng state must be the dict rng_state"):
        set_rng_state({"torch": torch.get_rng_state()})
