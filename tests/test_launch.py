"""paratrain launch: the torchrun argument table, validation, and real torchrun runs with gloo on CPU.

The runs start real torchrun processes (no mocks) running tests/scripts/dist_probe.py, which all-reduces its
rank over gloo and writes what torchrun told it to one JSON file per rank. Every run has a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from paratrain.cli import main as cli_main
from paratrain.cli.launch import add_launch_parser
from paratrain.errors import ConfigError, DistributedError
from paratrain.launch.launcher import LaunchConfig, launch, local_world_size, torchrun_args
from processes import cli_command, free_port

PROBE = str(Path(__file__).parent / "scripts" / "dist_probe.py")
TIMEOUT_S = 120
COMMON = "--max-restarts=0 --monitor-interval=0.1"  # the defaults


def _launch_command() -> list[str]:
    """The launcher as a user runs it."""
    return cli_command("launch")


def _main(argv: list[str]) -> int:
    return cli_main(["launch", *argv])


def _reports(out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    files = sorted(out_dir.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(world_size)], files
    return [json.loads(f.read_text()) for f in files]


def _check_world(reports: list[dict[str, Any]], nnodes: int, nproc_per_node: int) -> None:
    """Every rank saw a consistent world and the all-reduce of the ranks gave 0 + 1 + ... + (world - 1)."""
    world_size = nnodes * nproc_per_node
    assert [int(r["RANK"]) for r in reports] == list(range(world_size))
    for r in reports:
        assert r["WORLD_SIZE"] == str(world_size)
        assert r["LOCAL_WORLD_SIZE"] == str(nproc_per_node)
        assert r["GROUP_WORLD_SIZE"] == str(nnodes)
        # torchrun numbers ranks node by node: RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * nproc_per_node + int(r["LOCAL_RANK"])
        assert r["MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(r["MASTER_PORT"]) < 65536
        assert r["reduced"] == sum(range(world_size))
    assert len({r["MASTER_PORT"] for r in reports}) == 1
    assert sorted(int(r["GROUP_RANK"]) for r in reports) == sorted(
        node for node in range(nnodes) for _ in range(nproc_per_node)
    )


# --- the argument table -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "module", "expected"),
    [
        pytest.param(
            LaunchConfig(nproc_per_node=2),
            False,
            "--nnodes=1 --nproc-per-node=2 {common} --standalone --local-addr=127.0.0.1",
            id="one-node",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=3, master_addr="10.0.0.5", max_restarts=2, monitor_interval=0.5),
            True,
            "--nnodes=1 --nproc-per-node=3 --max-restarts=2 --monitor-interval=0.5 --standalone "
            "--local-addr=10.0.0.5 --module",
            id="one-node-module",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=1, master_port=29600),
            False,
            "--nnodes=1 --nproc-per-node=1 {common} --master-addr=127.0.0.1 --master-port=29600 --node-rank=0",
            id="one-node-fixed-port",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=2, nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29500),
            False,
            "--nnodes=2 --nproc-per-node=2 {common} --master-addr=10.0.0.1 --master-port=29500 --node-rank=1",
            id="static-two-nodes",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=4, nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job42", rdzv_timeout=30),
            False,
            "--nnodes=2 --nproc-per-node=4 {common} --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 "
            "--rdzv-id=job42 --rdzv-conf=join_timeout=30,read_timeout=30",
            id="c10d-two-nodes",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=1, nnodes="1:4", rdzv_endpoint="localhost:29400", max_restarts=3),
            False,
            "--nnodes=1:4 --nproc-per-node=1 --max-restarts=3 --monitor-interval=0.1 --rdzv-backend=c10d "
            "--rdzv-endpoint=localhost:29400 --rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,"
            "last_call_timeout=3 --local-addr=127.0.0.1",
            id="c10d-elastic-loopback",
        ),
        pytest.param(
            LaunchConfig(nproc_per_node=1, nnodes=2, rdzv_endpoint="[::1]:29400", local_addr="::1"),
            False,
            "--nnodes=2 --nproc-per-node=1 {common} --rdzv-backend=c10d --rdzv-endpoint=[::1]:29400 --local-addr=::1",
            id="c10d-ipv6",
        ),
    ],
)
def test_torchrun_args_table(config: LaunchConfig, module: bool, expected: str) -> None:
    script = "pkg.train" if module else "train.py"
    args = torchrun_args(config, script, ["--epochs", "3", "--nnodes", "9"], module=module)
    # the script and its arguments come last and untouched, so torchrun never reads the script's own flags
    assert args == [*expected.format(common=COMMON).split(), script, "--epochs", "3", "--nnodes", "9"]


def test_auto_is_one_process_per_accelerator_and_one_without() -> None:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    count = accelerator.device_count() if accelerator is not None and accelerator.is_available() else 0
    assert local_world_size("auto") == (count or 1)
    assert local_world_size("3") == local_world_size(3) == 3
    assert torchrun_args(LaunchConfig(), "t.py", [])[1] == f"--nproc-per-node={count or 1}"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LaunchConfig(nproc_per_node=0), "positive integer or 'auto'"),
        (LaunchConfig(nproc_per_node="gpu"), "found 'gpu'"),
        (LaunchConfig(nnodes="2:1"), "1 <= MIN <= MAX"),
        (LaunchConfig(nnodes="two"), "MIN:MAX"),
        (LaunchConfig(nnodes="1:2:3"), "MIN:MAX"),
        (LaunchConfig(nnodes=0), "1 <= MIN"),
        (LaunchConfig(nnodes=2, node_rank=2, master_addr="h", master_port=1), "0 .. 1 for 2 node"),
        (LaunchConfig(node_rank=-1), "node_rank: expected an integer >= 0"),
        (LaunchConfig(master_port=70000), "port number 1..65535, found 70000"),
        (LaunchConfig(master_port=0), "port number 1..65535"),
        (LaunchConfig(nnodes=2, rdzv_endpoint="10.0.0.1"), "expected HOST:PORT"),
        (LaunchConfig(nnodes=2, rdzv_endpoint="10.0.0.1:port"), "numeric port"),
        (LaunchConfig(nnodes=2, rdzv_endpoint="10.0.0.1:0"), "port number 1..65535"),
        (LaunchConfig(nnodes=2, rdzv_endpoint="::1:29400"), "[::1]:29400"),
        (LaunchConfig(nnodes=2), "--master-addr and --master-port"),
        (LaunchConfig(nnodes=2, master_addr="10.0.0.1"), "--master-addr and --master-port"),
        (LaunchConfig(nnodes="1:2"), "needs the c10d rendezvous"),
        (LaunchConfig(rdzv_endpoint="h:1", master_port=2), "found both"),
        (LaunchConfig(max_restarts=-1), "max_restarts"),
        (LaunchConfig(monitor_interval=0), "monitor_interval"),
        (LaunchConfig(rdzv_timeout=0), "rdzv_timeout"),
        (LaunchConfig(master_addr=""), "master_addr: expected a non-empty string"),
    ],
)
def test_validation_errors_say_what_was_expected(config: LaunchConfig, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.check()
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_valid_configs_pass() -> None:
    LaunchConfig().check()
    LaunchConfig(rdzv_endpoint="localhost:0").check()  # one node may let the OS pick the rendezvous port
    LaunchConfig(nnodes="2:2", rdzv_endpoint="h:29400", node_rank=1).check()


def test_script_name_and_missing_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="script path or module name"):
        torchrun_args(LaunchConfig(), "--oops", [])
    missing = str(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match=r"no file at .*missing\.py"):
        launch(LaunchConfig(nproc_per_node=1), missing, [])
    # the command line: a usage error, exit code 2, one line naming the file
    assert _main(["--nproc-per-node", "1", missing]) == 2
    err = capsys.readouterr().err
    assert "missing.py" in err and err.startswith("paratrain launch: error:")
    assert _main(["--nnodes", "2", PROBE]) == 2
    assert "--master-addr and --master-port" in capsys.readouterr().err


def test_parser_passes_everything_after_the_script_through() -> None:
    parser = argparse.ArgumentParser(prog="paratrain")
    add_launch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["launch", "--nproc-per-node", "2", "--nnodes", "1:2", "t.py", "--nnodes", "3", "-m"])
    assert (args.nproc_per_node, args.nnodes, args.script, args.script_args) == (
        2,
        "1:2",
        "t.py",
        ["--nnodes", "3", "-m"],
    )
    assert args.module is False and callable(args.handler)
    args = parser.parse_args(["launch", "-m", "pkg.train", "--lr", "0.1"])
    assert (args.module, args.script, args.script_args, args.nproc_per_node) == (
        True,
        "pkg.train",
        ["--lr", "0.1"],
        "auto",
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["launch", "--nproc-per-node", "zero", "t.py"])


def test_the_first_failure_is_a_rank_that_ended_on_its_own() -> None:
    """A rank the launcher stopped after another failed, whose error file is older, is not the job's failure."""
    from types import SimpleNamespace

    from paratrain.launch.failures import first_failure, summary_lines

    stopped = SimpleNamespace(exitcode=-signal.SIGTERM, timestamp=100, message={"message": "ConfigError: x"})
    failed = SimpleNamespace(exitcode=1, timestamp=101, message={"message": "ConfigError: x"})
    failures = {0: failed, 1: stopped, 2: SimpleNamespace(exitcode=-signal.SIGTERM, timestamp=102, message="")}
    assert first_failure(failures) == 0
    assert summary_lines(failures, 0) == [
        "rank 0 exited with code 1: ConfigError: x",
        "rank 1 was stopped by the launcher after rank 0 failed",
        "rank 2 was stopped by the launcher after rank 0 failed",
    ]
    # every rank stopped (a signal to the job): the earliest, as torchrun picks it; ties go to the lowest rank
    assert first_failure({3: stopped, 1: stopped}) == 1
    assert first_failure({0: failed, 2: SimpleNamespace(exitcode=1, timestamp=100, message="")}) == 2
    # a rank killed from outside (SIGKILL) before the others failed is the failure, as torchrun says
    killed = SimpleNamespace(exitcode=-signal.SIGKILL, timestamp=100, message="")
    assert first_failure({0: failed, 1: killed}) == 1


# --- real torchrun runs -------------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("nproc", [2, 3])
def test_single_node_workers_see_torchrun_env(tmp_path: Path, nproc: int) -> None:
    code = launch(LaunchConfig(nproc_per_node=nproc), PROBE, [str(tmp_path), "x", "--flag"], timeout=TIMEOUT_S)
    assert code == 0
    reports = _reports(tmp_path, nproc)
    _check_world(reports, nnodes=1, nproc_per_node=nproc)
    assert [int(r["LOCAL_RANK"]) for r in reports] == list(range(nproc))
    assert all(r["extra"] == ["x", "--flag"] and r["TORCHELASTIC_RESTART_COUNT"] == "0" for r in reports)


@pytest.mark.processes
def test_a_failing_worker_is_one_line_with_its_error_and_the_job_exits_with_its_code(tmp_path: Path) -> None:
    command = [
        *_launch_command(),
        "--nproc-per-node",
        "2",
        PROBE,
        str(tmp_path),
        "--exit-code",
        "3",
        "--exit-rank",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 3, done.stderr  # the failed worker's code
    # one line for the failed rank, with the last line it wrote to stderr, instead of torchrun's traceback
    lines = done.stderr.strip().splitlines()
    assert "paratrain launch: rank 1 exited with code 3: dist_probe: rank 1 exits with 3 on purpose" in lines
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    report = lines[-1].removeprefix("paratrain launch: torchrun's full report: ")
    assert report != lines[-1] and "ChildFailedError" in Path(report).read_text()  # kept where the line says
    assert Path(report).parent.name.startswith("paratrain-launch-")  # the job's directory: remove it once read
    shutil.rmtree(Path(report).parent)
    # the wrapper runs as __main__ without `import paratrain` having loaded it first (runpy's RuntimeWarning)
    assert "RuntimeWarning" not in done.stderr, done.stderr


@pytest.mark.processes
def test_the_same_error_on_every_rank_is_printed_once(tmp_path: Path) -> None:
    script = tmp_path / "wrong_devices.py"
    script.write_text('import paratrain\npar = paratrain.Parallel("ddp", devices=["cpu", "cpu", "cpu"])\n')
    command = [*_launch_command(), "--nproc-per-node", "3", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    # one traceback (each rank failed on the same line with the same message), not one per rank
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert 'File "' + str(script) + '", line 2, in <module>' in done.stderr
    error = "paratrain.errors.ConfigError: strategy 'ddp' runs one process per device"
    assert done.stderr.count(error) == 1, done.stderr
    # the launcher's summary still names each failed rank with its error
    assert re.search(r"paratrain launch: rank \d exited with code 1: ConfigError: strategy 'ddp'", done.stderr)
    report = done.stderr.strip().splitlines()[-1].removeprefix("paratrain launch: torchrun's full report: ")
    job = Path(report).parent
    assert not [p.name for p in job.iterdir() if p.name.startswith("shown-")]  # the markers went with the job
    shutil.rmtree(job)


@pytest.mark.processes
@pytest.mark.slow
def test_a_master_port_another_program_holds_is_one_usage_line(tmp_path: Path) -> None:
    """A second job on the first one's --master-port: one line naming the port and what to pass, exit 2."""
    script = tmp_path / "tiny.py"
    script.write_text("print('ran')\n")
    with socket.socket() as holder:  # what the first job's store would be
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        command = [*_launch_command(), "--master-port", str(port), str(script)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 2, done.stderr  # a usage error: the command line named a port in use
    assert done.stderr.splitlines() == [
        f"paratrain launch: error: --master-port {port}: port {port} on 127.0.0.1 is in use by another program "
        "(another job?); give another --master-port, or leave it out (a free one is then chosen)"
    ], done.stderr
    assert "ran" not in done.stdout


@pytest.mark.processes
def test_max_restarts_recovers_from_a_failed_first_attempt(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = LaunchConfig(nproc_per_node=2, max_restarts=1)
    assert launch(config, PROBE, [str(tmp_path), "--fail-first-attempt"], timeout=TIMEOUT_S) == 0
    err = capfd.readouterr().err  # not swallowed: torchrun and its workers write to our stderr
    assert "rank 0 fails its first attempt on purpose" in err
    assert "paratrain launch: the workers failed: restarting them (restart 1 of 1)" in err
    reports = _reports(tmp_path, 2)
    _check_world(reports, nnodes=1, nproc_per_node=2)
    assert [r["TORCHELASTIC_RESTART_COUNT"] for r in reports] == ["1", "1"]


@pytest.mark.processes
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
@pytest.mark.slow
def test_two_node_agents_on_one_machine(tmp_path: Path, rendezvous: str) -> None:
    """Two `paratrain launch` processes, one per node, meet over loopback and form one world of two."""
    port = free_port()
    if rendezvous == "c10d":
        meet = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-two-nodes"]
    else:
        meet = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    agents = []
    for node_rank in (0, 1):
        command = [*_launch_command(), "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1"]
        command += [*meet, "--rdzv-timeout", "60", PROBE, str(tmp_path)]
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    reports = _reports(tmp_path, 2)
    _check_world(reports, nnodes=2, nproc_per_node=1)
    assert all(r["LOCAL_RANK"] == "0" for r in reports)
    if rendezvous == "static":  # only the static rendezvous keeps the node ranks given; c10d numbers them itself
        assert [r["GROUP_RANK"] for r in reports] == ["0", "1"]


@pytest.mark.processes
def test_interrupt_stops_torchrun_and_its_workers(tmp_path: Path) -> None:
    command = [*_launch_command(), "--nproc-per-node", "2", PROBE, str(tmp_path), "--sleep", "300"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = [tmp_path / f"started{r}.json" for r in (0, 1)]
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in started):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the workers did not start within 60 s"
            time.sleep(0.1)
        pids = [json.loads(p.read_text())["pid"] for p in started]
        launcher.send_signal(signal.SIGINT)  # only to the launcher, as Ctrl-C would be (torchrun has its own session)
        _, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, err
    assert "interrupted" in err
    for pid in pids:  # torchrun stopped its workers before it exited
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.processes
def test_timeout_stops_the_job(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError, match="did not finish within 3 s"):
        launch(LaunchConfig(nproc_per_node=1), PROBE, [str(tmp_path), "--sleep", "300"], timeout=3)
    assert time.monotonic() - started < 60


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # slow to stop, as a rank saving a checkpoint is
sleeper = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.processes
@pytest.mark.slow
def test_a_second_ctrl_c_stops_every_process_of_the_job_at_once(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    # a long grace: after one Ctrl-C torchrun would wait a minute for the worker before killing it
    command = [*_launch_command(), "--nproc-per-node", "1", "--shutdown-timeout", "60", str(script)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        grandchild = int(launcher.stdout.readline())  # the worker started it, in a session of its own
        launcher.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert launcher.poll() is None  # the first Ctrl-C waits for the workers to stop
        second = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
        took = time.monotonic() - second
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130 and took < 10, (took, err)
    assert "interrupted again: stopping every process of the job now" in err
    deadline = time.monotonic() + 5
    while _running(grandchild):  # killed; its new parent reaps it when it gets to it
        assert time.monotonic() < deadline, "the worker's child outlived the second Ctrl-C"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended, and waits only to be reaped
