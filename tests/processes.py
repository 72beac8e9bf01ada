"""Real processes for the tests: the ``paratrain`` command, gloo process groups, ports.

run_cli("train", "--epochs", "1")                     # finished: returncode, stdout, stderr
proc = start_cli("train", "--strategy", "ddp")         # running: a Popen to finish() or signal
run_ranks(fn, 3, tmp_path)                             # fn(rank, world_size) in 3 processes over gloo
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

CLI_TIMEOUT_S = 180


def cli_command(*args: str) -> list[str]:
    """``paratrain ARGS`` as a user runs it (``python -m paratrain``, this interpreter)."""
    return [sys.executable, "-m", "paratrain", *args]


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {})}


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``paratrain ARGS`` to the end; ``env`` adds to this process's environment."""
    return subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=timeout, env=_env(env), cwd=cwd)


def start_cli(*args: str, env: Mapping[str, str] | None = None, merge_stderr: bool = False) -> subprocess.Popen[str]:
    """Start ``paratrain ARGS`` and return at once; ``finish()`` waits for it."""
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    return subprocess.Popen(cli_command(*args), stdout=subprocess.PIPE, stderr=stderr, text=True, env=_env(env))


def finish(proc: subprocess.Popen[str], timeout: float = CLI_TIMEOUT_S, expect: int | None = 0) -> str:
    """Wait for ``proc`` (killed after ``timeout``); check its exit code when ``expect`` is given; its stdout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if expect is not None:
        assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{out}\n{err}"
    return out


def free_port() -> int:
    """A port free on 127.0.0.1 now, for the few tests that must name one (another program may still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, store: str, fn: Callable[..., Any], out_dir: str, args: tuple) -> None:
    os.chdir(out_dir)  # what a rank writes where it runs (a hang report, say) lands beside its result
    try:
        # a file store: no port to pick, so no other program can take it first
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as exc:  # reported to the parent, which fails the test with it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # skip the process-group teardown: after a deliberate timeout it can block; the process is ending anyway
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any, timeout: float = 120, exits: int | None = None
) -> list[Any]:
    """fn(rank, world_size, *args) in every rank; returns each rank's JSON-able value, or raises its error.

    ``exits``: a rank whose process is meant to end without a result (its entry is then None).
    """
    out_dir = Path(tempfile.mkdtemp(prefix=f"ranks-{fn.__name__}-{world_size}-", dir=tmp_path))
    ctx = mp.start_processes(
        _worker,
        args=(world_size, str(out_dir / "store"), fn, str(out_dir), args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    # not ctx.join(): it stops every rank as soon as one exits with an error
    while any(proc.is_alive() for proc in ctx.processes):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise AssertionError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout}s")
        time.sleep(0.05)
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if rank == exits:
            results.append(None)
            continue
        if not path.exists():
            code = ctx.processes[rank].exitcode
            raise AssertionError(f"rank {rank} wrote no result (exit code {code})")
        results.append(json.loads(path.read_text()))
    failed = [r for r in results if r is not None and not r["ok"]]
    if failed:
        raise AssertionError("\n\n".join(r["traceback"] for r in failed))
    return [None if r is None else r["value"] for r in results]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the command name may hold spaces and parentheses: the fields after its last ")" are safe
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_with_rank(launcher: int, rank: int) -> int | None:
    """The process below ``launcher`` whose environment says ``RANK=rank`` (a torchrun worker), if any."""
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
            return pid
    return None
