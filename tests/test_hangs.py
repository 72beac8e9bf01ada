"""When a job hangs: it ends, for library users too, under every launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 3.0


def _launchers() -> dict[str, list[str]]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    two = ["--nproc-per-node", "2"]
    return {
        "torchrun": [torchrun, "--standalone", *two],
        "python -m torch.distributed.run": [sys.executable, "-m", "torch.distributed.run", "--standalone", *two],
        "paratrain launch": [sys.executable, "-m", "paratrain", "launch", *two],
    }


def _run(command: list[str]) -> tuple[int, float, str]:
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    return done.returncode, time.monotonic() - started, done.stdout + done.stderr


@pytest.mark.processes
def test_a_rank_sleeping_in_user_code_ends_the_job_soon_after_the_timeout_under_every_launcher():
    """Rank 1 sleeps 120 s before a backward; rank 0's collective times out after 3 s. The job (started anew for
    each launcher: DDP under torchrun, Parallel under the others) must end within timeout + 15 s, failing."""
    runs = {
        name: [
            *launcher,
            str(SCRIPTS / "user_hang.py"),
            *("--api", "ddp" if name == "torchrun" else "parallel"),
            *("--timeout", str(TIMEOUT)),
        ]
        for name, launcher in _launchers().items()
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        results = dict(zip(runs, pool.map(_run, runs.values()), strict=True))
    for name, (code, seconds, output) in results.items():
        assert code != 0, f"{name}: exit 0\n{output[-3000:]}"
        assert "rank(s) 1 did not arrive" in output, f"{name}\n{output[-3000:]}"
        # startup (imports, rendezvous) on a loaded 2-core machine is part of the figure: the bound is generous on
        # it and tight on the hang, which alone took 120 s before
        assert seconds < TIMEOUT + 15 + 10, f"{name}: ended after {seconds:.0f} s\n{output[-3000:]}"
