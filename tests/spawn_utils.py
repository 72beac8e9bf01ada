"""Run a function in N real processes joined by a gloo process group, and collect what each returns."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as exc:  # reported to the parent, which fails the test with it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # skip the process-group teardown: after a deliberate timeout it can block; the process is ending anyway
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *args: Any, timeout: float = 120) -> list[Any]:
    """fn(rank, world_size, *args) in every rank; returns each rank's JSON-able value, or raises its error."""
    out_dir = tmp_path / f"ranks-{fn.__name__}-{world_size}"
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(
        _worker,
        args=(world_size, free_port(), fn, str(out_dir), args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise AssertionError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout}s")
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"rank {rank} wrote no result")
        results.append(json.loads(path.read_text()))
    failed = [r for r in results if not r["ok"]]
    if failed:
        raise AssertionError("\n\n".join(r["traceback"] for r in failed))
    return [r["value"] for r in results]
