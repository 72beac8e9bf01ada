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

from paratrain.diagnostics.hang_report import HangReport, RankReport
from paratrain.diagnostics.skipped import paratrain_call, paratrain_calls
from paratrain.diagnostics.stacks import PACKAGE_DIR
from paratrain.errors import CollectiveError
from paratrain.launch.failures import error_line

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
            assert "which rank 1 did not make" in output, tail  # said by rank 0, which made it (issue 27)
        elif fault == "shapes":  # gloo refuses mismatched sizes by aborting; faulthandler shows where
            line = _line_of("of a different size per rank")
            assert "collective mismatch" in output and f'user_hang.py", line {line}' in output, tail


def _skipped_run(call: str, workdir: Path) -> tuple[int, str]:
    """``paratrain launch`` of user_skipped.py, its output as the console shows it (stdout and stderr in one pipe)."""
    command = [*_launchers()["paratrain launch"], str(SCRIPTS / "user_skipped.py"), "--call", call]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "--timeout", str(TIMEOUT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=150,
        env=env,
        cwd=workdir,
    )
    return done.returncode, done.stdout


def _skipped_line(text: str) -> int:
    lines = (SCRIPTS / "user_skipped.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


@pytest.mark.processes
def test_a_collective_only_rank_0_makes_is_named_with_its_line_by_rank_0_once(tmp_path):
    """Issue 27: rank 0 all-reduces alone (a bucket's size, so gloo pairs it with rank 1's bucket), rank 1 finishes
    and leaves. Rank 0, ahead in the group's numbers, names the extra collective and its line, once; the launcher's
    summary points to it in one short line; the exit code is rank 0's, 1."""
    code, output = _skipped_run("extra", tmp_path)
    site = f"rank 0 ran all_reduce(float [10]) at {SCRIPTS / 'user_skipped.py'}:{_skipped_line('only rank 0 makes')}"
    assert code == 1, output
    assert output.count(site) == 1, output
    assert "which rank 1 did not make" in output, output
    assert output.count("Connection closed by peer") <= 1, output  # gloo's text, when quoted, once
    assert "paratrain launch: rank 0 exited with code 1: CollectiveError: " in output, output
    summary = next(line for line in output.splitlines() if line.startswith("paratrain launch: rank 0 exited"))
    assert "the diagnosis is in rank 0's output above" in summary and site not in summary, summary


@pytest.mark.processes
def test_a_paratrain_call_only_rank_0_makes_is_named_with_its_line_and_the_rule(tmp_path):
    """Issue 27: par.barrier() under ``if par.is_main:``. Each rank's error names the call, its line and the rule,
    once per rank; the launcher's summary lines point to them."""
    code, output = _skipped_run("barrier", tmp_path)
    call = f"rank 0 in par.barrier() at {SCRIPTS / 'user_skipped.py'}:{_skipped_line('call only rank 0 makes')}"
    assert code == 1, output
    assert call in output and "Every rank calls par.barrier() at the same point" in output, output
    errors = [line for line in output.splitlines() if line.startswith("paratrain.errors.CollectiveError: ")]
    assert errors and all(call in line for line in errors), output
    assert len({line.split(":", 2)[1] for line in errors}) == len(errors), output  # one diagnosis a rank
    summaries = [line for line in output.splitlines() if line.startswith("paratrain launch: rank ")]
    assert all(call not in line for line in summaries), summaries


def test_a_stack_in_a_paratrain_call_names_the_call_and_the_users_line():
    """The frames a report carries (innermost last): the user's line, then paratrain's public call."""
    user = {"file": "/home/me/train.py", "line": 40, "function": "<module>"}
    barrier = [user, {"file": f"{PACKAGE_DIR}/parallel.py", "line": 476, "function": "barrier"}]
    backward = [{**user, "line": 35}, {"file": f"{PACKAGE_DIR}/parallel.py", "line": 339, "function": "backward"}]
    assert paratrain_call(barrier) == ("par.barrier()", "/home/me/train.py:40", False)
    assert paratrain_call(backward) == ("par.backward()", "/home/me/train.py:35", True)
    assert paratrain_call([user]) is None

    def rank(r: int, frames: list) -> RankReport:
        return RankReport(r, "alive", True, stacks=[{"thread": "MainThread", "frames": frames}])

    apart = HangReport(0, "", 1, 3.0, 0.0, [rank(0, barrier), rank(1, backward)])
    said = paratrain_calls(apart)
    assert "rank 0 in par.barrier() at /home/me/train.py:40, rank 1 in par.backward() at /home/me/train.py:35" in said
    assert "Every rank calls par.barrier() at the same point" in said
    together = HangReport(0, "", 1, 3.0, 0.0, [rank(0, backward), rank(1, backward)])
    assert paratrain_calls(together) == ""  # the same call on every rank: a stall, not a skipped call


def test_the_launchers_line_for_a_collective_error_is_its_short_summary():
    """The message holds the whole diagnosis, printed once by the rank; the launcher's summary quotes the pointer."""
    error = CollectiveError("rank 0: barrier (collective #1) did not complete within 3s: ...", summary="rank 0: short")
    assert error_line(error) == "CollectiveError: rank 0: short"
    assert error_line(ValueError("bad")) == "ValueError: bad"
