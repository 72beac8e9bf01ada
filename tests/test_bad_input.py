"""Bad input, damaged files and what a job exposes, tried as a careful new user and as a hostile tester would."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import run_main
from paratrain.checkpoint.file import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from paratrain.errors import CheckpointError, ConfigError
from paratrain.training import TrainConfig, train
from processes import cli_command, descendants, run_cli, start_cli

# --- numbers and flag combinations: exit 2 with one line, before anything starts --------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr", "inf"], "--lr: expected a finite number, found 'inf'"),
        (["--lr", "1e300"], "--lr must be positive and below 3.4e+38; found 1e+300"),
        (["--timeout", "inf"], "--timeout: expected a finite number, found 'inf'"),
        (["--momentum", "nan"], "--momentum: expected a finite number, found 'nan'"),
        (["--strategy", "ddp", "--devices", "cpu,cpu"], "--strategy ddp runs one process per device and takes"),
        (["--strategy", "single", "--nproc-per-node", "2"], "--nproc-per-node start processes for strategy ddp"),
        (["--strategy", "single", "--timeout", "5"], "timeout is for strategy 'ddp'"),
        (["--metrics-out", "/proc/version/x.json"], "--metrics-out /proc/version/x.json: /proc/version is a file"),
    ],
)
def test_bad_numbers_and_combinations_exit_2_with_one_line_before_any_work(capsys, args, message):
    started = time.monotonic()
    code, out, err = run_main(capsys, "train", "--epochs", "1", *args)
    assert code == 2, err
    assert message in err and err.strip().count("\n") == 0
    assert "Traceback" not in err and "Epoch" not in out
    assert time.monotonic() - started < 60  # refused up front, not after a run


@pytest.mark.processes
def test_an_unwritable_metrics_path_is_refused_before_training_not_after(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = run_cli("train", "--metrics-out", str(blocker / "m.json"))
    assert result.returncode == 2 and "nothing can be created under it" in result.stderr
    assert result.stdout == ""  # not one step: the results would have been lost at the end


@pytest.mark.processes
@pytest.mark.slow
def test_a_run_that_diverges_stops_with_an_error_instead_of_exiting_0():
    result = run_cli("train", "--epochs", "1", "--quiet", "--lr", "1e30")
    assert result.returncode == 1 and "the training loss became" in result.stderr and "diverged" in result.stderr


# --- a damaged checkpoint ------------------------------------------------------------------------------------------


def test_a_checkpoint_with_flipped_bytes_is_refused_naming_the_last_good_one(tmp_path):
    """64 bytes flipped in the middle of the file (inside a tensor): loaded silently before digests."""
    state = {"model": {"w": torch.randn(256, 256)}, "step": 1}
    good = save_checkpoint(state, tmp_path, "epoch-0000-step-000010.pt")
    damaged = save_checkpoint({**state, "step": 2}, tmp_path, "epoch-0000-step-000020.pt")
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is damaged: its contents do not match the digest") as info:
        load_checkpoint(damaged)
    assert f"The newest checkpoint before it that verifies is {good}" in str(info.value)
    assert load_checkpoint(good)["step"] == 1


@pytest.mark.processes
@pytest.mark.slow
def test_resume_refuses_a_damaged_checkpoint_from_the_command_line(tmp_path):
    directory = tmp_path / "ckpt"
    first = run_cli("train", "--epochs", "2", "--quiet", "--checkpoint-dir", str(directory))
    assert first.returncode == 0, first.stderr
    newest = latest_checkpoint(directory)
    data = bytearray(newest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    newest.write_bytes(bytes(data))
    result = run_cli("train", "--epochs", "3", "--quiet", "--checkpoint-dir", str(directory), "--resume")
    assert result.returncode == 1 and "is damaged" in result.stderr
    assert str(list_checkpoints(directory)[-2]) in result.stderr


# --- settings on resume: those that may change take effect, and are recorded ---------------------------------------


def test_a_new_learning_rate_on_resume_is_used_and_recorded(tmp_path):
    directory = tmp_path / "ckpt"
    train(TrainConfig(epochs=1, quiet=True, checkpoint_dir=str(directory)))
    resume = str(latest_checkpoint(directory))
    same = train(TrainConfig(epochs=2, quiet=True, checkpoint_dir=str(tmp_path / "a"), resume=resume))
    faster = train(TrainConfig(epochs=2, lr=0.05, quiet=True, checkpoint_dir=str(tmp_path / "b"), resume=resume))
    assert faster.lr == 0.05 and faster.optimizer_settings["lr"] == 0.05
    assert same.optimizer_settings["lr"] == 0.01
    assert faster.model_fingerprint != same.model_fingerprint  # the new rate really trained
    state = load_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.05
    with pytest.raises(ConfigError, match="--batch-size: checkpoint 64, this run 32"):
        train(TrainConfig(epochs=2, batch_size=32, quiet=True, resume=resume))


# --- what a job exposes ----------------------------------------------------------------------------------------------


def _listening_sockets(pids: list[int]) -> list[str]:
    """The TCP addresses the given processes listen on, read from /proc (address:port, hex as the kernel has it)."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def _is_loopback(hex_address: str) -> bool:
    address = hex_address.split(":")[0]
    if len(address) == 8:  # IPv4, little-endian: 0100007F is 127.0.0.1
        return bytes.fromhex(address)[::-1][0] == 127
    return address == "00000000000000000000000001000000"  # ::1


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc to list listening sockets")
@pytest.mark.slow
def test_a_one_machine_job_listens_on_loopback_only():
    """torchrun's stores listen on every interface by default; a one-machine job through paratrain does not."""
    proc = start_cli("train", "--strategy", "ddp", "--nproc-per-node", "2", "--dataset", "digits60k", "--quiet")
    try:
        deadline = time.monotonic() + 120
        listening: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            listening = _listening_sockets([proc.pid, *descendants(proc.pid)])
            if len(listening) >= 3:  # the rendezvous store, the workers' store and gloo's listeners
                break
            time.sleep(0.2)
        assert listening, "the job listened on nothing, so this test proved nothing"
        assert all(_is_loopback(a) for a in listening), listening
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:  # the launcher's children first: they have their own session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


# --- paths this user cannot reach: a usage error before anything starts ---------------------------------------------


@pytest.fixture
def unsearchable(tmp_path_factory):
    """A directory that user 65534 (nobody) may not enter, and a command prefix that runs as that user."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as another user")
    base = Path(tempfile.mkdtemp(prefix="paratrain-perm-"))  # under /tmp, which every user may enter
    base.chmod(0o755)
    locked = base / "locked"
    locked.mkdir()
    locked.chmod(0o700)  # root's alone: no execute (search) permission for anyone else
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*as_nobody, sys.executable, "-c", "import paratrain"], capture_output=True, text=True,
                           cwd="/tmp", timeout=60)  # fmt: skip
    if probe.returncode != 0:  # a clone under a private directory (mode 700, as many homes are): nobody cannot
        shutil.rmtree(base)  # reach this interpreter or the package, so the test would measure the clone's place
        pytest.skip(f"user nobody cannot run this checkout's paratrain ({_unsearchable_above(Path(sys.executable))})")
    yield locked, as_nobody
    shutil.rmtree(base)


def _unsearchable_above(path: Path) -> str:
    """The first directory above ``path`` that others may not search, as the skip's reason names it."""
    for parent in reversed(path.absolute().parents):
        if not parent.stat().st_mode & 0o001:
            return f"{parent} is mode {parent.stat().st_mode & 0o777:o}"
    return "its interpreter or package is not readable by others"


@pytest.mark.processes
@pytest.mark.parametrize(
    "flag, relative, extra",
    [
        ("--metrics-out", "m.json", ()),
        ("--checkpoint-dir", "ckpt", ()),
        ("--log-dir", "logs", ("--no-tensorboard", "--no-plot")),
        ("--data-dir", "", ("--dataset", "mnist")),
    ],
)
@pytest.mark.slow
def test_a_path_this_user_cannot_search_is_a_usage_error_before_training(unsearchable, flag, relative, extra):
    locked, as_nobody = unsearchable
    path = str(locked / relative) if relative else str(locked)
    command = [*as_nobody, *cli_command("train", "--epochs", "1", "--quiet", flag, path, *extra)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
    assert flag in result.stderr and "Permission denied" in result.stderr, result.stderr
    assert result.stdout == ""  # not one step
