"""What happens when things fail, driven with real processes and real files: kills mid-write, write errors.

Each test starts `paratrain train` as a user would, breaks something for real (SIGKILL, a file-size limit), and
checks what is left on disk and what the next run does with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from fault_scenarios import a_peers_proposal_then_this_ranks_own_ctrl_c, a_rank_that_cannot_write_its_slices
from paratrain.checkpoint.file import checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint
from paratrain.checkpoint.sharded import is_sharded_checkpoint, materialize, read_plain, verify_sharded
from paratrain.training import TrainConfig, train
from processes import cli_command, descendants, finish, free_port, run_cli, run_ranks, start_cli, worker_with_rank

pytestmark = pytest.mark.processes  # every test here starts processes

# an MLP of 11.9M parameters: a 48 MB checkpoint whose write takes a few tenths of a second here
BIG = ("--model", "mlp", "--width", "3072", "--depth", "2", "--quiet")


def _temporaries(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one_and_resume_works(tmp_path):
    directory = tmp_path / "ckpt"
    common = (*BIG, "--epochs", "1", "--checkpoint-dir", str(directory), "--keep-checkpoints", "50")
    proc = start_cli("train", *common, "--checkpoint-every", "2")
    deadline = time.monotonic() + 120
    try:
        # wait until one checkpoint is complete and the next one is being written, then kill the writer
        while not (list_checkpoints(directory) and _temporaries(directory)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint write to interrupt within 120 s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        finish(proc, expect=None)
    assert proc.returncode == -signal.SIGKILL
    written = list_checkpoints(directory)
    assert written, "the first checkpoint should have survived"
    for path in written:
        load_checkpoint(path)  # every checkpoint on disk is whole
    resumed = run_cli("train", *common, "--resume", "--max-steps", "1", "--metrics-out", str(tmp_path / "m.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "m.json").exists()


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs a file-size limit (POSIX)")
def test_a_write_error_is_a_clear_error_and_leaves_no_half_file(tmp_path):
    directory = tmp_path / "ckpt"
    first = run_cli("train", "--quiet", "--epochs", "1", "--checkpoint-dir", str(directory))
    assert first.returncode == 0, first.stderr
    (before,) = list_checkpoints(directory)
    original = before.read_bytes()
    # SimpleNet's checkpoint is about 0.8 MB: with a 0.5 MB limit on file sizes the next write fails midway
    command = cli_command("train", "--quiet", "--epochs", "2", "--checkpoint-dir", str(directory), "--resume")
    failed = subprocess.run(
        command, capture_output=True, text=True, timeout=120, preexec_fn=lambda: _limit_file_size(500_000)
    )
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    assert "could not write checkpoint" in failed.stderr and "File too large" in failed.stderr
    assert list_checkpoints(directory) == [before] and before.read_bytes() == original
    assert _temporaries(directory) == []  # no half-written file left behind


# --- a stalled rank: named, then the whole job ends ---------------------------------------------------------------


@pytest.mark.slow
def test_a_stopped_worker_is_named_and_the_job_ends_soon_after_the_timeout(tmp_path):
    """SIGSTOP rank 1 mid-run: rank 0 names it within the timeout, exits, and torchrun ends the job."""
    timeout = 5
    proc = start_cli(
        "train", "--strategy", "ddp", "--nproc-per-node", "2", "--timeout", str(timeout), "--dataset", "digits60k",
        "--epochs", "1", "--log-every", "20", "--hang-report", str(tmp_path / "hang.json"),
        env={"OMP_NUM_THREADS": "1"}, merge_stderr=True,
    )  # fmt: skip
    lines: list[str] = []
    stopped_at = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stopped_at is None and "Step 40," in line:
                victim = worker_with_rank(proc.pid, 1)
                assert victim is not None, "found no worker with RANK=1"
                os.kill(victim, signal.SIGSTOP)
                stopped_at = time.monotonic()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert stopped_at is not None, output
    ended_after = time.monotonic() - stopped_at
    assert proc.returncode == 1, output
    assert f"did not complete within {timeout}s: rank(s) 1 did not arrive" in output
    assert "show no sign of life" in output
    # the launcher's line for the rank that failed first, quoting its error, instead of torchrun's traceback
    assert "paratrain train: rank 0 exited with code 1: paratrain train: error: " in output, output
    assert "ChildFailedError" not in output
    assert ended_after < timeout + 15, f"the job ended {ended_after:.1f}s after the stop\n{output}"
    report = json.loads((tmp_path / "hang.json").read_text())  # the report of every rank, where it was asked for
    assert [r["state"].split(":")[0] for r in report["ranks"]] == ["alive", "stopped"], report["ranks"]


# --- a dead worker: restarted, resumed, the same model ----------------------------------------------------------

RESTART_RUN = ("--strategy", "ddp", "--nproc-per-node", "2", "--dataset", "digits60k", "--quiet", "--epochs", "1")
RESTART_RUN += ("--max-steps", "240", "--checkpoint-every", "40", "--keep-checkpoints", "10")
SHARDED = ("zero1", "zero2", "zero3")


def _as(strategy: str, run: tuple[str, ...] = RESTART_RUN) -> tuple[str, ...]:
    """``run`` under another strategy."""
    at = run.index("--strategy") + 1
    return (*run[:at], strategy, *run[at + 1 :])


def _without(run: tuple[str, ...], flag: str, values: int = 0) -> tuple[str, ...]:
    """``run`` without ``flag`` and the ``values`` after it."""
    at = run.index(flag)
    return (*run[:at], *run[at + 1 + values :])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The model fingerprint of RESTART_RUN trained to its end without a fault: ddp's, which zero1, zero2 and zero3
    equal bit for bit at two ranks (tests/test_zero.py, tests/test_zero3.py), so one run serves every strategy."""
    metrics = tmp_path_factory.mktemp("uninterrupted") / "m.json"
    finish(start_cli("train", *RESTART_RUN, "--metrics-out", str(metrics), env={"OMP_NUM_THREADS": "1"}))
    return str(json.loads(metrics.read_text())["model_fingerprint"])


def _kill_rank_1_at_step_100(run: tuple[str, ...], directory: Path, metrics: Path) -> dict:
    """Run ``run`` under ``--max-restarts 1``, SIGKILL rank 1 once step 100 is logged (20 steps after the checkpoint
    at 80); the metrics of the run, which the restarted workers finished."""
    proc = start_cli(
        "train", *_without(run, "--quiet"), "--log-every", "10", "--checkpoint-dir", str(directory),
        "--max-restarts", "1", "--metrics-out", str(metrics), env={"OMP_NUM_THREADS": "1"}, merge_stderr=True,
    )  # fmt: skip
    output: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if "Step 100," in line and len([x for x in output if "Step 100," in x]) == 1:
                victim = worker_with_rank(proc.pid, 1)
                assert victim is not None
                os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, "".join(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result: dict = json.loads(metrics.read_text())
    return result


def _check_resumed(resumed: dict, fingerprint: str) -> None:
    """The restarted run ended with the uninterrupted run's model, resumed from the latest checkpoint."""
    assert resumed["model_fingerprint"] == fingerprint
    assert resumed["restarts"] == 1 and len(resumed["recoveries"]) == 1
    recovery = resumed["recoveries"][0]
    assert recovery["resumed_at_step"] in (80, 120)  # the latest checkpoint, not step 0 (120 if the kill came late)
    if recovery["resumed_at_step"] == 80:  # step 100 was done when its line was printed: at least 21 steps lost
        assert 21 <= resumed["steps_redone"] < 40, resumed
    assert 0 < resumed["recovery_seconds"] < 60


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes_from_the_latest_checkpoint(tmp_path, uninterrupted):
    """Rank 1 SIGKILLed at step 100, 20 steps after the checkpoint at 80: resumed there, the same model, the steps
    lost counted exactly."""
    _check_resumed(_kill_rank_1_at_step_100(RESTART_RUN, tmp_path / "ckpt", tmp_path / "m.json"), uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SHARDED)
def test_a_killed_worker_under_a_sharded_strategy_resumes_from_its_slices(tmp_path, uninterrupted, strategy):
    """As above under zero1, zero2 and zero3: the restarted workers read their slices of the latest sharded
    checkpoint (a directory every rank wrote) and end with the uninterrupted ddp run's model, bit for bit."""
    directory = tmp_path / "ckpt"
    _check_resumed(_kill_rank_1_at_step_100(_as(strategy), directory, tmp_path / "m.json"), uninterrupted)
    assert all(is_sharded_checkpoint(path) for path in list_checkpoints(directory))


@pytest.mark.slow
def test_a_restart_after_the_last_step_trains_no_further(tmp_path):
    """A worker killed while the run was ending (after its last checkpoint, before progress.json says finished):
    the restarted attempt resumes at --max-steps and stops there, with the model of the run that ended."""
    run = ("train", "--strategy", "single", "--dataset", "digits", "--quiet", "--epochs", "3", "--max-steps", "30")
    run += ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10")
    env = {"TORCHELASTIC_RUN_ID": "job-1"}
    first = run_cli(*run, "--metrics-out", str(tmp_path / "first.json"), env=env)
    assert first.returncode == 0, first.stderr
    progress = tmp_path / "ckpt" / "progress.json"
    record = json.loads(progress.read_text())
    assert record["finished"] is True and record["global_step"] == 30
    progress.write_text(json.dumps({**record, "finished": False}))  # what a SIGKILL before the end leaves
    again = run_cli(*run, "--metrics-out", str(tmp_path / "again.json"), env={**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert again.returncode == 0, again.stderr
    before, after = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("first", "again"))
    assert after["steps"] == 0, "the restarted attempt trained past --max-steps"
    assert after["model_fingerprint"] == before["model_fingerprint"]
    assert after["restarts"] == 1 and after["recoveries"][0]["resumed_at_step"] == 30


@pytest.mark.slow
def test_restarts_without_checkpoints_are_refused():
    result = run_cli("train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-restarts", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "--max-restarts 1 restarts the workers after a failure" in result.stderr and "--checkpoint-dir" in result.stderr
    )


# --- elastic membership: a lost node --------------------------------------------------------------------------

ELASTIC_RUN = ("--strategy", "ddp", "--dataset", "digits60k", "--quiet", "--epochs", "1", "--max-steps", "240")
ELASTIC_RUN += ("--checkpoint-every", "40", "--keep-checkpoints", "10")


def _step(checkpoint: Path) -> int:
    return int(checkpoint.stem.rsplit("-", 1)[1])


def _listener(port: int, agents: list[subprocess.Popen[str]]) -> subprocess.Popen[str] | None:
    """Which agent's process tree listens on ``port`` (hosts the rendezvous store), from /proc; None while none."""
    hex_port = f":{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(hex_port) and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for agent in agents:
        for pid in [agent.pid, *descendants(agent.pid)]:
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                    return agent
    return None


def _in_world_of(agent: subprocess.Popen[str], size: int) -> bool:
    """Whether a torchrun worker below ``agent`` runs in a group of ``size`` processes."""
    for pid in descendants(agent.pid):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"WORLD_SIZE={size}".encode() in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
                return True
    return False


def _mtime(path: Path) -> float:
    """When ``path`` last changed; 0 while it is not there (a checkpoint being replaced by one of the same name)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_a_lost_node_leaves_the_survivor_to_resume_and_finish_alone(tmp_path, strategy):
    """Two node agents (--nnodes 1:2, one process each); SIGKILL one agent's whole process tree mid-run. Under zero1,
    zero2 and zero3 the survivor, alone, reads the slices both ranks wrote (every slice of the checkpoint, its own
    shard now)."""
    port, directory = free_port(), tmp_path / "ckpt"
    common = (*_as(strategy, ELASTIC_RUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2")
    common += ("--rdzv-id", f"lost-{strategy}")
    common += ("--rdzv-endpoint", f"127.0.0.1:{port}", "--checkpoint-dir", str(directory))
    env = {"OMP_NUM_THREADS": "1"}
    # both agents start at once, so both meet in the first round (one that starts seconds later, as a loaded machine
    # makes it, misses the round's 3 s last call, and the first may finish alone before it re-forms); the one that
    # hosts the rendezvous store is the survivor (the store must outlive the kill), the other the victim
    agents = [start_cli("train", *common, "--metrics-out", str(tmp_path / f"{n}.json"), env=env) for n in "ab"]
    survivor = victim = None
    try:
        deadline = time.monotonic() + 60
        while (survivor := _listener(port, agents)) is None:
            assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, "no agent listened"
            time.sleep(0.1)
        victim = next(a for a in agents if a is not survivor)
        # the kill comes after the two-node group wrote a checkpoint
        while not _in_world_of(victim, 2):
            assert survivor.poll() is None and victim.poll() is None, "an agent ended early"
            assert time.monotonic() < deadline + 120, "the victim never joined the group"
            time.sleep(0.05)
        joined = time.time()
        while not [p for p in list_checkpoints(directory) if _mtime(p) > joined + 0.5 and _step(p) >= 80]:
            assert survivor.poll() is None and victim.poll() is None, "an agent ended early"
            assert time.monotonic() < deadline + 180, "no checkpoint at step 80 or later from the two-node group"
            time.sleep(0.01)
        for pid in [victim.pid, *descendants(victim.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        finish(survivor, timeout=240)
    except AssertionError as failed:  # what each agent said, for the next person to read
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
        outputs = ["".join(a.communicate()) for a in agents]
        said = [f"agent {n} (exit {a.returncode}):\n{o[-3000:]}" for n, a, o in zip("ab", agents, outputs, strict=True)]
        raise AssertionError("\n".join([str(failed), *said])) from None
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
        for proc in agents:
            if proc.returncode is None:
                proc.communicate()
    metrics = json.loads((tmp_path / f"{'ab'[agents.index(survivor)]}.json").read_text())
    # one restart for the lost node (and one before it where the group re-formed to take the victim in)
    assert metrics["world_size"] == 1 and metrics["restarts"] in (1, 2), metrics["recoveries"]
    assert metrics["recoveries"][-1]["resumed_at_step"] >= 80
    # the same as resuming that checkpoint by hand at the survivors' world size: bit for bit
    (resumed,) = [p for p in list_checkpoints(directory) if _step(p) == metrics["recoveries"][-1]["resumed_at_step"]]
    by_hand = tmp_path / "by-hand"
    by_hand.mkdir()
    copied = by_hand / resumed.name
    (shutil.copytree if resumed.is_dir() else shutil.copy2)(resumed, copied)
    left = 240 - _step(resumed)  # --max-steps counts this invocation's steps
    hand_run = (*_without(_as(strategy, ELASTIC_RUN), "--max-steps", 1), "--max-steps", str(left))
    hand_run += ("--nproc-per-node", "1", "--checkpoint-dir", str(by_hand), "--resume", str(copied))
    again = run_cli("train", *hand_run, env=env)
    assert again.returncode == 0, again.stderr
    mine, hand = (materialize(read_plain(latest_checkpoint(d)))["model"] for d in (directory, by_hand))
    far = max(float((mine[key] - hand[key]).abs().max()) for key in hand)
    assert far == 0, f"the elastic resume is {far:g} off the resume by hand at world size 1"
    reference = tmp_path / "reference"
    train(TrainConfig(dataset="digits60k", epochs=1, max_steps=240, quiet=True, checkpoint_dir=str(reference)))
    mine, theirs = (materialize(read_plain(latest_checkpoint(d)))["model"] for d in (directory, reference))
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], atol=1e-4, rtol=0)


# --- a rendezvous no one answers --------------------------------------------------------------------------------


@pytest.mark.parametrize("meet", ["static", "c10d"])
@pytest.mark.slow
def test_an_endpoint_no_one_answers_fails_within_the_rendezvous_timeout_naming_it(meet):
    """Node 1 of 2 waits for a node 0 that never starts (static), or for a second node that never joins (c10d)."""
    port = free_port()
    where = (
        ["--node-rank", "1", "--master-addr", "127.0.0.2", "--master-port", str(port)]
        if meet == "static"
        else ["--rdzv-endpoint", f"127.0.0.2:{port}"]
    )
    started = time.monotonic()
    result = run_cli(
        "launch", "--nnodes", "2", "--nproc-per-node", "1", *where, "--rdzv-timeout", "5",
        str(Path(__file__).parent / "scripts" / "dist_probe.py"), "/nonexistent",
    )  # fmt: skip
    took = time.monotonic() - started
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain launch: error: the nodes did not meet") and f"127.0.0.2:{port}" in last
    assert "--rdzv-timeout 5 s" in last
    assert took < 2 * 5 + 40, f"{took:.0f} s"  # twice the timeout, plus start-up on a loaded machine


# --- Ctrl-C: one clean stop, a checkpoint where the run was, and --resume continues from it ------------------------


def _interrupt_after(proc: subprocess.Popen[str], line_start: str) -> str:
    """Read ``proc``'s stdout until a line starts with ``line_start``, then send SIGINT to ``proc`` (only: as a
    terminal's Ctrl-C reaches the launcher, torchrun and its workers running in sessions of their own)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(line_start):
            proc.send_signal(signal.SIGINT)
            return "".join(seen)
    raise AssertionError(f"the run ended before {line_start!r}:\n{''.join(seen)}")


def _stopped_at(out: str, err: str = "") -> tuple[int, Path]:
    lines = [line for line in out.splitlines() if line.startswith("Interrupted: ")]
    assert len(lines) == 1, f"expected one 'Interrupted: ' line, found {len(lines)}:\n{out}\n--- stderr ---\n{err}"
    (line,) = lines
    assert line.endswith("; the same command with --resume continues from there"), line
    step = int(line.split("stopped after step ")[1].split()[0])
    return step, Path(line.split(" and saved ")[1].split(";")[0])


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resume_ends_as_the_uninterrupted_run(tmp_path):
    args = ("train", "--epochs", "3", "--log-every", "1", "--checkpoint-dir", str(tmp_path))
    proc = start_cli(*args)
    seen = _interrupt_after(proc, "Epoch 1, Step 5,")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "", err  # one line says it all, on stdout; no traceback
    step, saved = _stopped_at(seen + out, err)
    assert saved.exists() and load_checkpoint(saved)["global_step"] == step and 23 + 6 <= step < 3 * 23
    metrics = tmp_path / "m.json"
    resumed = run_cli(*args, "--resume", "--quiet", "--metrics-out", str(metrics))
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(metrics.read_text())
    assert result["resumed_from"] == str(saved) and result["steps"] == 3 * 23 - step
    assert result["model_fingerprint"] == train(TrainConfig(epochs=3, quiet=True)).model_fingerprint


def test_a_rank_that_learns_a_peers_stop_before_its_own_ctrl_c_takes_that_ctrl_c_as_its_first(tmp_path):
    """The launcher signals every rank, but a rank waiting in a collective runs its handler late, after its watcher
    may have read rank 0's proposal: that SIGINT is still its first (it used to count as the second, and end the
    rank at once with 130, its slices unsaved and rank 0 failing in the save's collectives). Both stop after the
    step rank 0 proposed."""
    first, second = run_ranks(a_peers_proposal_then_this_ranks_own_ctrl_c, 2, tmp_path)
    assert first["signals"] == 1 and not first["proposed"], first
    assert second["signals"] == 1 and second["proposed"], second
    assert first["agreed"] == second["agreed"] > 5 and first["stops"] == second["stops"] == [first["agreed"]]


@pytest.mark.slow
def test_ctrl_c_under_ddp_stops_every_rank_after_the_same_step_in_one_line(tmp_path):
    # the ranks agree on a step about half a second ahead: an epoch of digits60k (938 steps) outlasts that
    args = ("train", "--strategy", "ddp", "--nproc-per-node", "2", "--dataset", "digits60k", "--epochs", "1")
    args += ("--log-every", "100", "--checkpoint-dir", str(tmp_path))
    proc = start_cli(*args, env={"OMP_NUM_THREADS": "1"})
    seen = _interrupt_after(proc, "Epoch 0, Step 100,")
    workers = descendants(proc.pid)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted" not in err and "Signal" not in err, err  # no line per rank
    step, saved = _stopped_at(seen + out, err)
    state = load_checkpoint(saved)
    assert state["global_step"] == step and (state["epoch"], state["batch"]) == (0, step) and 100 < step < 938
    for pid in workers:  # the launcher, torchrun and both ranks are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    metrics = tmp_path / "m.json"
    more = ("--resume", "--quiet", "--max-steps", "20", "--metrics-out", str(metrics))
    resumed = run_cli(*args, *more, env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(metrics.read_text())  # the ranks resumed together from the step rank 0 named
    assert result["resumed_from"] == str(saved) and result["steps"] == 20


# --- the sharded strategies: every rank writes its slices -----------------------------------------------------


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs a file-size limit (POSIX)")
def test_a_rank_that_cannot_write_its_slices_is_named_to_every_rank_at_once(tmp_path):
    """One rank's write fails (zero1, zero2, zero3): every rank's par.save raises the same error naming it within
    a second, not after the timeout (60 s) the others waited for it in a barrier; a loop that goes on stays in step."""
    found = run_ranks(a_rank_that_cannot_write_its_slices, 2, tmp_path, str(tmp_path / "ckpt"), timeout=240)
    for strategy in ("zero1", "zero2", "zero3"):
        errors = {rank[strategy]["error"] for rank in found}
        assert len(errors) == 1, errors  # the same words on every rank
        (error,) = errors
        assert error is not None and "rank 1 could not write" in error and "shard-00001.pt" in error, error
        assert "File too large (errno 27)" in error and "Nothing was published" in error, error
        assert max(rank[strategy]["seconds"] for rank in found) < 5, found
        # the failed checkpoint left nothing, not even its hidden directory; the next one is whole
        assert found[0][strategy]["entries"] == ["epoch-0000-step-000002.pt"], found[0][strategy]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", SHARDED)
def test_ctrl_c_under_a_sharded_strategy_saves_one_sharded_checkpoint_and_resume_ends_as_the_uninterrupted_run(
    tmp_path, uninterrupted, strategy
):
    """Ctrl-C at step 100 of RESTART_RUN under zero1, zero2 and zero3: every rank stops after the same step and
    writes its slices of one checkpoint, one line says where; --resume latest trains the remaining steps to the
    uninterrupted model."""
    directory = tmp_path / "ckpt"
    run = _without(_without(_as(strategy), "--quiet"), "--max-steps", 1)  # each invocation gets its own
    run += ("--checkpoint-dir", str(directory))
    env = {"OMP_NUM_THREADS": "1"}
    proc = start_cli("train", *run, "--max-steps", "240", "--log-every", "10", env=env)
    seen = _interrupt_after(proc, "Epoch 0, Step 100,")
    workers = descendants(proc.pid)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted" not in err and "Signal" not in err, err  # no line per rank
    step, saved = _stopped_at(seen + out, err)
    assert 100 < step < 240 and is_sharded_checkpoint(saved), saved
    assert sorted(p.name for p in saved.iterdir()) == ["index.pt", "shard-00000.pt", "shard-00001.pt"]
    assert read_plain(saved)["global_step"] == step and latest_checkpoint(directory) == saved
    assert not list(directory.glob(".*.partial"))
    for pid in workers:  # the launcher, torchrun and both ranks are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    metrics = tmp_path / "m.json"
    rest = ("--max-steps", str(240 - step), "--quiet", "--metrics-out", str(metrics), "--resume", "latest")
    resumed = run_cli("train", *run, *rest, env=env)
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(metrics.read_text())
    assert result["resumed_from"] == str(saved) and result["steps"] == 240 - step
    assert result["model_fingerprint"] == uninterrupted


# an MLP of 11.9M parameters on 2 ranks (zero2 here; killed_mid_write runs it under each sharded strategy): each
# rank's slices are a 24 MB file, written in a few tenths
BIG_SHARDED = ("--strategy", "zero2", "--nproc-per-node", "2", *BIG, "--epochs", "1", "--checkpoint-every", "2")
BIG_SHARDED += ("--keep-checkpoints", "50")


def _shard_temporary(directory: Path, rank: int) -> int | None:
    """The pid of the process writing rank ``rank``'s slices of a checkpoint in ``directory`` (the temporary file
    of ``shard-0000r.pt`` names it), once a checkpoint is complete there; None otherwise."""
    if not list_checkpoints(directory):
        return None
    for partial in directory.glob(".*.partial"):
        with contextlib.suppress(OSError):
            for name in os.listdir(partial):
                if name.startswith(f".shard-{rank:05d}.pt.") and name.endswith(".tmp"):
                    return int(name.split(".")[-3])
    return None


@pytest.fixture(scope="module", params=SHARDED)
def killed_mid_write(request, tmp_path_factory) -> dict:
    """A run under each sharded strategy whose rank 1 is SIGKILLed while it writes its slices of the second
    checkpoint (the first is complete): its command line, directory and output, how long the job took to end after
    the kill. One launch per strategy, which the tests after it share (each on a copy of the directory)."""
    run = _as(request.param, BIG_SHARDED)
    directory = tmp_path_factory.mktemp(f"killed-mid-write-{request.param}") / "ckpt"
    proc = start_cli("train", *run, "--checkpoint-dir", str(directory), env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    try:
        while (pid := _shard_temporary(directory, 1)) is None:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no slices to interrupt within 180 s"
            time.sleep(0.002)
        assert pid == worker_with_rank(proc.pid, 1)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        finish(proc, expect=None)
    took = time.monotonic() - killed
    return {"run": run, "directory": directory, "output": out + err, "seconds": took, "code": proc.returncode}


def _copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.slow
def test_a_rank_killed_while_writing_its_slices_ends_the_job_in_seconds_and_resume_takes_the_previous_one(
    killed_mid_write, tmp_path
):
    output, directory = killed_mid_write["output"], killed_mid_write["directory"]
    assert killed_mid_write["code"] == 128 + signal.SIGKILL, output  # the first failed rank's: rank 1's signal
    assert "rank 1 was killed by SIGKILL" in output and "rank 0 was stopped by the launcher" in output, output
    assert killed_mid_write["seconds"] < 15, output  # the launcher stops rank 0 at once, not at the timeout (300 s)
    (partial,) = directory.glob(".*.partial")  # the damaged one, hidden: no name a checkpoint has
    (previous,) = list_checkpoints(directory)
    assert partial.name == f".{checkpoint_name(0, 4)}.partial" and _step(previous) == 2
    verify_sharded(previous)  # every slice of the previous one is there and matches its digest
    copy = _copy_of(directory, tmp_path)
    more = ("--resume", "latest", "--max-steps", "1", "--metrics-out", str(tmp_path / "m.json"))
    run = killed_mid_write["run"]
    resumed = run_cli("train", *run, "--checkpoint-dir", str(copy), *more, env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "m.json").read_text())["resumed_from"] == str(copy / previous.name)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs a file-size limit (POSIX)")
def test_a_write_error_on_every_rank_names_each_rank_and_path_and_publishes_nothing(killed_mid_write, tmp_path):
    """Resumed with a 5 MB file-size limit on every process: the first save fails on both ranks (zero1, zero2,
    zero3: the run of killed_mid_write)."""
    directory = _copy_of(killed_mid_write["directory"], tmp_path)
    (previous,) = list_checkpoints(directory)
    files = {path.name: path.read_bytes() for path in previous.iterdir()}
    command = cli_command("train", *killed_mid_write["run"], "--checkpoint-dir", str(directory), "--resume", "latest")
    failed = subprocess.run(
        command, capture_output=True, text=True, timeout=180, preexec_fn=lambda: _limit_file_size(5_000_000)
    )
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    # resumed from step 2 (not from the half-written step 4), the save at step 4 failed on both ranks
    lost = directory / checkpoint_name(0, 4)
    for rank in (0, 1):
        partial = directory / f".{lost.name}.partial" / f"shard-{rank:05d}.pt"
        assert f"rank {rank} could not write {partial}: File too large (errno 27)" in failed.stderr, failed.stderr
    assert f"paratrain train: error: checkpoint {lost} was not written" in failed.stderr
    assert list_checkpoints(directory) == [previous]
    assert {path.name: path.read_bytes() for path in previous.iterdir()} == files  # intact, to the byte
    assert not list(directory.glob(".*")), list(directory.glob(".*"))  # no partial directory or file left


def _remove_a_slice_file(checkpoint: Path) -> None:
    (checkpoint / "shard-00001.pt").unlink()


def _change_a_slice(checkpoint: Path) -> None:
    shard = checkpoint / "shard-00001.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the tensor data (the file is 24 MB of it): the same size, other values
    shard.write_bytes(bytes(raw))


def _truncate_the_index(checkpoint: Path) -> None:
    index = checkpoint / "index.pt"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])


DAMAGES = {
    "a slice file removed": (_remove_a_slice_file, "shard-00001.pt is missing, the index says"),
    "a slice's bytes changed": (_change_a_slice, "is damaged: a slice in shard-00001.pt does not match its digest"),
    "the index cut short": (_truncate_the_index, "index.pt is truncated or corrupt"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_sharded_checkpoint_is_refused_before_any_rank_trains(killed_mid_write, tmp_path, damage):
    """A real checkpoint of zero1, zero2 or zero3 damaged by hand: --resume latest names what is wrong and trains no
    step (a file missing or of the wrong size and the index are checked before the ranks start; a slice's digest as
    it is read)."""
    directory = _copy_of(killed_mid_write["directory"], tmp_path)
    (previous,) = list_checkpoints(directory)
    spoil, said = DAMAGES[damage]
    spoil(previous)
    run = _without(killed_mid_write["run"], "--quiet")
    result = run_cli("train", *run, "--log-every", "1", "--checkpoint-dir", str(directory), "--resume", "latest")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and said in result.stderr and str(directory) in result.stderr
    assert "Step " not in result.stdout, result.stdout  # not one step trained
    assert list_checkpoints(directory) == [previous]  # nothing written
