"""Writing files without destroying what is not ours: regular files, devices, links, directories, dead writers,
and the files a process needs while it runs, in a temporary directory others share."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratrain.diagnostics.stacks import signal_dump
from paratrain.errors import ConfigError
from paratrain.files import JOB_DIR_ENV, atomic_writer, check_output, remove_stale_temporaries, scratch_directory
from paratrain.launch.failures import record_error
from processes import run_cli


def _write(path: Path | str, text: str) -> None:
    with atomic_writer(path, "w") as f:
        f.write(text)


def test_a_regular_file_is_replaced_whole(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    _write(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(target, "w") as f:
        f.write("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_device_is_written_through_never_replaced():
    """A pseudo-terminal is a character device we own: written into, and still a device afterwards."""
    primary, secondary = os.openpty()
    try:
        device = os.ttyname(secondary)
        _write(device, "through the device\n")
        assert stat.S_ISCHR(os.stat(device).st_mode)
        assert b"through the device" in os.read(primary, 1024)
    finally:
        os.close(primary)
        os.close(secondary)


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path):
    real = tmp_path / "real" / "metrics.json"
    real.parent.mkdir()
    real.write_text("stale")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    _write(link, "fresh")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "fresh"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "later.json")
    _write(dangling, "created where the link points")
    assert dangling.is_symlink() and (tmp_path / "later.json").read_text() == "created where the link points"


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(IsADirectoryError):
        _write(tmp_path, "x")
    with pytest.raises(ConfigError, match="is a directory"):
        check_output(tmp_path, "--metrics-out")


@pytest.mark.parametrize(
    "relative, message",
    [
        ("file/below.json", r"file is a file, so nothing can be created under it"),
        ("dir", r"is a directory"),
    ],
)
def test_check_output_says_what_is_wrong_before_anything_runs(tmp_path, relative, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match=message):
        check_output(tmp_path / relative, "--metrics-out")
    assert check_output(tmp_path / "new" / "deep" / "m.json", "--metrics-out") == tmp_path / "new" / "deep" / "m.json"
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.processes
def test_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    """A writer SIGKILLed mid-write leaves its temporary file; the next run removes it, not a live writer's."""
    script = textwrap.dedent(
        """
        import os, sys
        from paratrain.files import atomic_writer
        with atomic_writer(sys.argv[1], "w") as f:
            f.write("half a checkpoint")
            f.flush()
            os._exit(9)  # dies inside the write: nothing cleans up
        """
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "c.pt")], check=False, timeout=60)
    (dead,) = tmp_path.glob(".c.pt.*.tmp")
    with atomic_writer(tmp_path / "other.pt", "w") as f:  # this process's own write, still under way
        f.write("in progress")
        (live,) = tmp_path.glob(".other.pt.*.tmp")
        assert remove_stale_temporaries(tmp_path) == [dead]
        assert live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt"]


@pytest.mark.processes
@pytest.mark.slow
def test_metrics_out_to_a_device_or_a_link_keeps_it_what_it_was(tmp_path):
    """The reported case: --metrics-out at a device turned it into a regular file. A link must stay a link."""
    real = tmp_path / "results" / "m.json"
    real.parent.mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(real)
    primary, secondary = os.openpty()
    try:
        for target in (str(link), os.ttyname(secondary)):
            result = run_cli("train", "--epochs", "1", "--quiet", "--metrics-out", target)
            assert result.returncode == 0, result.stderr
        assert stat.S_ISCHR(os.stat(os.ttyname(secondary)).st_mode)
        assert b"model_fingerprint" in os.read(primary, 1 << 16)
    finally:
        os.close(primary)
        os.close(secondary)
    assert link.is_symlink() and "model_fingerprint" in json.loads(real.read_text())


def test_with_follow_links_false_a_planted_link_is_replaced_and_its_target_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "victim-dir").mkdir()
    for name, target in (("to-file", victim), ("to-dir", tmp_path / "victim-dir"), ("to-null", Path(os.devnull))):
        planted = tmp_path / name
        planted.symlink_to(target)
        with atomic_writer(planted, "w", follow_links=False) as f:
            f.write("ours")
        assert not planted.is_symlink() and planted.read_text() == "ours", name
    assert victim.read_text() == "precious" and list((tmp_path / "victim-dir").iterdir()) == []


def test_the_error_file_of_a_worker_never_follows_a_link_planted_at_its_name(tmp_path, monkeypatch):
    """torchrun names each rank's error file (.../attempt_0/RANK/error.json): a name anyone can predict."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = tmp_path / "error.json"
    planted.symlink_to(victim)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(planted))
    record_error("ConfigError: on purpose")
    assert victim.read_text() == "precious"
    assert (
        not planted.is_symlink() and json.loads(planted.read_text())["message"]["message"] == "ConfigError: on purpose"
    )


def test_scratch_files_go_in_the_jobs_directory_only_when_it_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "shared"))
    (tmp_path / "shared").mkdir()
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setenv(JOB_DIR_ENV, str(job))
    assert scratch_directory() == job
    job.chmod(0o777)  # others may write there: as shared as TMPDIR, so TMPDIR it is
    assert scratch_directory() == tmp_path / "shared"
    job.chmod(0o700)
    (tmp_path / "link").symlink_to(job)
    monkeypatch.setenv(JOB_DIR_ENV, str(tmp_path / "link"))
    assert scratch_directory() == tmp_path / "shared"


_ARMED = textwrap.dedent(
    """
    import os, sys, tempfile
    from pathlib import Path
    # the links someone may plant, at every name this process can predict: the old one, with its pid
    for name in (f"paratrain-stacks-{os.getpid()}.txt", f"paratrain-stacks-{os.getpid()}-.txt"):
        (Path(tempfile.gettempdir()) / name).symlink_to(sys.argv[1])
    from paratrain.diagnostics.stacks import arm_signal_dump
    print(arm_signal_dump(), flush=True)
    sys.stdin.readline()  # until the test has looked
    """
)


def _armed(shared: Path, victim: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "TMPDIR": str(shared)}
    env.pop(JOB_DIR_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _ARMED, str(victim)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


@pytest.mark.processes
@pytest.mark.parametrize("asked", [False, True], ids=["never asked", "asked for its stacks"])
def test_the_stack_file_follows_no_planted_link_and_goes_at_exit_unless_it_holds_stacks(tmp_path, asked):
    """The reported case: paratrain-stacks-<pid>.txt in the shared temporary directory followed a planted link (its
    target was truncated) and stayed after every run."""
    shared, victim = tmp_path / "shared", tmp_path / "victim.txt"
    shared.mkdir()
    victim.write_text("precious")
    proc, path = _armed(shared, victim)
    try:
        assert victim.read_text() == "precious"
        assert path.parent == shared and path.is_file() and not path.is_symlink(), path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        text = signal_dump(proc.pid, str(path), wait=10.0) if asked else None
        assert not asked or (text is not None and "Current thread" in text and "<string>" in text), text
        proc.communicate("done\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and victim.read_text() == "precious"
    planted = sorted(p.name for p in shared.iterdir() if p.is_symlink())
    left = sorted(p.name for p in shared.iterdir() if not p.is_symlink())
    assert len(planted) == 2
    assert left == ([path.name] if asked else []), left  # kept only with the stacks someone asked for
