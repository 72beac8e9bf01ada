"""What each fault costs, measured once each with real processes: the figures of the README's failure table.

    python scripts/fault_figures.py                 # every fault below, a few minutes on a small machine
    python scripts/fault_figures.py --only stall restart

- stall: `paratrain train --strategy ddp --nproc-per-node 2 --timeout T`, rank 1 stopped (SIGSTOP) mid-epoch;
  seconds from the stop to the named error, and to the end of the whole job.
- restart: the same with --max-restarts 2 and checkpoints every 40 steps, rank 1 killed (SIGKILL) at step 100
  (20 steps after the checkpoint at 80); the metrics' restarts, steps_redone, recovery_seconds, and whether the final
  model is bitwise the uninterrupted run's.
- node-loss: two elastic node agents (--nnodes 1:2), one killed with its process tree; the survivor's recovery.
- endpoint: node 1 of 2 waiting for a node 0 that never starts (static rendezvous) or for a second node that
  never joins (c10d), --rdzv-timeout 5; seconds until `paratrain launch` exits naming the endpoint.

The tests in tests/test_faults.py drive the same faults and assert bounds; this script prints the figures.
Writes JSON (default benchmarks/results/fault_figures.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["--strategy", "ddp", "--dataset", "digits60k", "--epochs", "1"]


def _cli(*args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "paratrain", "train", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found += [child]
            todo.append(child)
    return found


def _rank(launcher: int, rank: int) -> int:
    for pid in _descendants(launcher):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
                return pid
    raise RuntimeError(f"no worker with RANK={rank} below {launcher}")


def stall(timeout: int) -> dict[str, float | int | None]:
    proc = _cli(*COMMON, "--nproc-per-node", "2", "--timeout", str(timeout), "--log-every", "20")
    stopped = named = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if stopped is None and "Step 40," in line:
            os.kill(_rank(proc.pid, 1), signal.SIGSTOP)
            stopped = time.monotonic()
        if stopped is not None and named is None and "did not arrive" in line:
            named = time.monotonic() - stopped
    proc.wait()
    ended = time.monotonic() - stopped if stopped is not None else None
    return {"timeout_s": timeout, "named_after_s": named, "job_ended_after_s": ended, "exit_code": proc.returncode}


def restart(directory: Path) -> dict[str, object]:
    run = [*COMMON, "--nproc-per-node", "2", "--max-steps", "240", "--checkpoint-every", "40"]
    proc = _cli(*run, "--log-every", "10", "--checkpoint-dir", str(directory / "ckpt"), "--max-restarts", "2",
                "--metrics-out", str(directory / "m.json"))  # fmt: skip
    assert proc.stdout is not None
    killed = False
    for line in proc.stdout:  # mid-interval: the steps since the checkpoint at 80 are lost
        if not killed and "Step 100," in line:
            os.kill(_rank(proc.pid, 1), signal.SIGKILL)
            killed = True
    proc.wait()
    resumed = json.loads((directory / "m.json").read_text())
    whole = _cli(*run, "--quiet", "--metrics-out", str(directory / "whole.json"))
    whole.communicate()
    same = resumed["model_fingerprint"] == json.loads((directory / "whole.json").read_text())["model_fingerprint"]
    keys = ("restarts", "steps_redone", "recovery_seconds")
    return {**{k: resumed[k] for k in keys}, "exit_code": proc.returncode, "same_model_as_uninterrupted": same}


def node_loss(directory: Path) -> dict[str, object]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = [*COMMON, "--max-steps", "240", "--checkpoint-every", "40", "--quiet", "--nnodes", "1:2"]
    run += ["--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "f"]
    run += ["--checkpoint-dir", str(directory / "ckpt")]
    survivor = _cli(*run, "--metrics-out", str(directory / "survivor.json"))
    time.sleep(3)
    victim = _cli(*run, "--metrics-out", str(directory / "victim.json"))
    while not (directory / "ckpt" / "epoch-0000-step-000080.pt").exists():
        time.sleep(0.01)
    for pid in [victim.pid, *_descendants(victim.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    survivor.communicate()
    victim.communicate()
    metrics = json.loads((directory / "survivor.json").read_text())
    return {k: metrics[k] for k in ("world_size", "restarts", "steps_redone", "recovery_seconds")}


def endpoint(meet: str, rdzv_timeout: int = 5) -> dict[str, object]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    where = ["--node-rank", "1", "--master-addr", "127.0.0.2", "--master-port", str(port)] if meet == "static" else [
        "--rdzv-endpoint", f"127.0.0.2:{port}"]  # fmt: skip
    command = [sys.executable, "-m", "paratrain", "launch", "--nnodes", "2", "--nproc-per-node", "1", *where]
    command += ["--rdzv-timeout", str(rdzv_timeout), str(ROOT / "scripts" / "exit_probe.py")]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV)
    took = time.monotonic() - started
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    return {"rdzv_timeout_s": rdzv_timeout, "exited_after_s": took, "exit_code": done.returncode, "message": last}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=["stall", "restart", "node-loss", "endpoint"])
    parser.add_argument("--timeout", type=int, default=10, help="--timeout of the stall run (default 10)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_figures.json"))
    args = parser.parse_args()
    chosen = args.only or ["stall", "restart", "node-loss", "endpoint"]
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "stall" in chosen:
            figures["stall"] = stall(args.timeout)
        if "restart" in chosen:
            (Path(tmp) / "restart").mkdir()
            figures["restart"] = restart(Path(tmp) / "restart")
        if "node-loss" in chosen:
            (Path(tmp) / "node").mkdir()
            figures["node-loss"] = node_loss(Path(tmp) / "node")
        if "endpoint" in chosen:
            figures["endpoint, static"] = endpoint("static")
            figures["endpoint, c10d"] = endpoint("c10d")
    for name, values in figures.items():
        print(f"{name:<10} {json.dumps(values)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
