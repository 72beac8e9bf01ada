"""When a job hangs: it ends, for library users too, under every launcher."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 3.0
# how soon after the fault a job ends: the timeout, a report that waits for every answering rank (torch's first
# symbolisation of call sites takes seconds on a loaded machine), and the launcher's teardown
ENDS_WITHIN_S = 30.0


def _launchers() -> dict[str, list[str]]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    two = ["--nproc-per-node", "2"]
    return {
        "torchrun": [torchrun, "--standalone", *two],
        "python -m torch.distributed.run": [sys.executable, "-m", "torch.distributed.run", "--standalone", *two],
        "paratrain launch": [sys.executable, "-m", "paratrain", "launch", *two],
    }


def _since_fault(output: str, ended: float) -> float:
    """Seconds from the fault (the script prints when a rank reaches it) to the end of the job."""
    found = [float(t) for t in re.findall(r"at fault ([\d.]+)", output)]
    return ended - min(found) if found else float("inf")


def _run(command: list[str]) -> tuple[int, float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    output = done.stdout + done.stderr
    return done.returncode, _since_fault(output, time.time()), output


def _matrix_run(launcher: str, api: str, fault: str, workdir: Path) -> tuple[int, float, str, dict | None]:
    (workdir / "tmp").mkdir(parents=True)  # the job's own temporary directory: what it leaves there is seen
    steps = "200" if fault == "only0" else "60"
    command = [*_launchers()[launcher], str(SCRIPTS / "user_hang.py"), "--api", api]
    command += ["--fault", fault, "--timeout", str(TIMEOUT), "--steps", steps]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(workdir / "tmp")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env, cwd=workdir)
    output = done.stdout + done.stderr
    report = workdir / "paratrain-hang-report.json"
    loaded = json.loads(report.read_text()) if report.exists() else None
    return done.returncode, _since_fault(output, time.time()), output, loaded


def _line_of(text: str) -> int:
    """The line of the user's script that holds ``text``."""
    lines = (SCRIPTS / "user_hang.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


def _rank(report: dict, rank: int) -> dict:
    return next(r for r in report["ranks"] if r["rank"] == rank)


def _left_unnamed(tmp: Path, output: str) -> list[str]:
    """What the job left in its temporary directory that no line of its output names: the directory's entries,
    and every stack file in them (torch's compile cache, torchinductor_<user>, is torch's and stays)."""
    entries = [p for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    entries += list(tmp.rglob("paratrain-stacks-*"))
    return sorted(str(p) for p in entries if str(p) not in output)


JOBS = [  # (launcher, API, fault): the fault matrix under paratrain launch, and the stall under torch's launchers
    *[("paratrain launch", "parallel", f) for f in ("sleep", "stop", "loop", "kill", "only0", "shapes", "slow")],
    ("paratrain launch", "parallel", "native"),  # only faulthandler's signal shows rank 1: its stack file is named
    ("torchrun", "ddp", "sleep"),
    ("python -m torch.distributed.run", "parallel", "sleep"),
]


@pytest.mark.slow
@pytest.mark.processes
def test_the_fault_matrix_each_job_ends_and_its_report_names_the_rank_its_state_and_the_users_line(tmp_path):
    """Real jobs of two real processes, one rank at fault in its second step. Each must end soon after the fault
    (within ENDS_WITHIN_S of it, a tenth of the 300 s default timeout they would otherwise wait), failing, with a
    report that names the right rank, its state and the user's line."""
    with ThreadPoolExecutor(3) as pool:  # more at once starve the ranks of a 2-core machine
        runs = list(pool.map(lambda job: _matrix_run(*job, tmp_path / "-".join(job[::2]).replace(" ", "_")), JOBS))
    for (launcher, _, fault), (code, seconds, output, report) in zip(JOBS, runs, strict=True):
        tail = f"{launcher}, {fault}: exit {code}, {seconds:.0f} s after the fault\n{output[-4000:]}"
        if launcher == "paratrain launch":  # its job's files: the ones a line names, or none
            tmp = tmp_path / f"{launcher}-{fault}".replace(" ", "_") / "tmp"
            assert _left_unnamed(tmp, output) == [], tail
        if fault == "slow":  # no fault: the job finishes, and the slower rank is the one the others waited for
            assert code == 0 and report is None, tail
            waits = {int(r): float(w) for r, w in re.findall(r"rank (\d) finished, waited ([\d.]+) s", output)}
            assert waits[0] > waits[1] + 1.0, waits
            continue
        assert code != 0 and seconds < ENDS_WITHIN_S, tail
        if fault in ("sleep", "loop"):
            assert report is not None and "rank(s) 1 did not arrive" in output, tail
            one = _rank(report, 1)
            line = _line_of("time.sleep(120)" if fault == "sleep" else "while True")
            # alive and answering; or, busy in a loop on a loaded machine, shown through faulthandler's signal
            assert one["state"] == "alive" or one["stacks_text"], one["state"]
            assert f"user_hang.py:{line}" in one["user_line"], one["user_line"]
            assert "user_hang.py" in _rank(report, 0)["user_line"] and _rank(report, 0)["waiting_in"], tail
        elif fault == "native":  # held in C, it cannot answer: its stacks come through faulthandler, into its file
            assert report is not None and "rank(s) 1 did not arrive" in output, tail
            one = _rank(report, 1)
            assert one["state"].startswith("did not answer from Python") and one["stacks_text"], one["state"]
            assert f"user_hang.py:{_line_of('sum(itertools.count())')}" in one["user_line"], one["user_line"]
            named = Path(one["stacks_file"])  # on this machine: the report named it, so it stays after the job
            assert named.read_text() == one["stacks_text"], named
            assert f"its stacks, as faulthandler wrote them: {named}" in output, tail
        elif fault == "stop":
            assert report is not None and _rank(report, 1)["state"].startswith("stopped"), tail
            assert "rank(s) 1 did not arrive; rank(s) 1 show no sign of life" in output, tail
        elif fault == "kill":  # the launcher saw it go first: its summary names the rank and the exit code
            ours = "rank 1 exited with code 3" in output  # paratrain launch's summary line; torchrun's below
            assert ours or re.search(r"rank\s*:\s*1 .*\n\s*exitcode\s*:\s*3", output), tail
        elif fault == "only0":  # found by the numbers drifting apart, long before the timeout would
            assert "ranks ran different collectives" in output and report is not None, tail
            line = _line_of("only rank 0 reaches")
            assert f"rank 0 ran all_reduce(float [10]) at {SCRIPTS / 'user_hang.py'}:{line}" in output, tail
            assert "rank 1 ran paratrain's gradient all-reduce of bucket 0" in output, tail
        elif fault == "shapes":  # gloo refuses mismatched sizes by aborting; faulthandler shows where
            line = _line_of("of a different size per rank")
            assert "collective mismatch" in output and f'user_hang.py", line {line}' in output, tail
