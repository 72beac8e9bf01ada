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
from paratrain.diagnostics.stacks import PACKAGE_DIR, UserLine, calling
from paratrain.errors import CollectiveError
from paratrain.launch.failures import error_line

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 3.0
# the collective timeout of jobs whose mistake must be named without waiting for it: the default. Their subprocess
# limit (150 s) is half of it, so a job that ends at all ended long before it
UNREACHED_TIMEOUT = 300.0
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


def _skipped_run(
    call: str, workdir: Path, timeout: float = TIMEOUT, script: str = "user_skipped.py"
) -> tuple[int, str]:
    """``paratrain launch`` of a user's script (user_skipped.py: ``--call``; user_zero3_forward.py: ``--where``), its
    output as the console shows it (stdout and stderr in one pipe)."""
    option = "--where" if script == "user_zero3_forward.py" else "--call"
    command = [*_launchers()["paratrain launch"], str(SCRIPTS / script), option, call]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "--timeout", str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=150,
        env=env,
        cwd=workdir,
    )
    return done.returncode, done.stdout


def _skipped_line(text: str, script: str = "user_skipped.py") -> int:
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


@pytest.mark.processes
def test_a_stalled_peer_in_zero2s_exchange_is_named_as_under_ddp(tmp_path):
    """zero2 at two ranks reduce-scatters by a send and a receive with the peer, not a collective: rank 1 stalls in
    its second step, and rank 0's receive still ends the job in seconds, its report naming rank 1 and its line."""
    command = [*_launchers()["paratrain launch"], str(SCRIPTS / "user_hang.py"), "--api", "parallel"]
    command += ["--strategy", "zero2", "--fault", "sleep", "--timeout", str(TIMEOUT), "--steps", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    output = done.stdout + done.stderr
    seconds = _since_fault(output, time.time())
    assert done.returncode != 0 and seconds < ENDS_WITHIN_S, output[-4000:]
    assert "rank(s) 1 did not arrive" in output, output[-4000:]
    report = json.loads((tmp_path / "paratrain-hang-report.json").read_text())
    assert f"user_hang.py:{_line_of('time.sleep(120)')}" in _rank(report, 1)["user_line"], report


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
@pytest.mark.parametrize(
    ("call", "marker"),
    [
        ("barrier", "call only rank 0 makes"),
        pytest.param("all_reduce", "metric only rank 0 all-reduces", marks=pytest.mark.slow),  # barrier's path again
    ],
)
def test_a_paratrain_call_only_rank_0_makes_is_named_once_with_its_line_and_the_rule(tmp_path, call, marker):
    """Issue 27, and par.all_reduce(t) under ``if rank == 0:`` (of another size than a bucket, which gloo would
    pair with rank 1's bucket and abort the process on): rank 0 meets rank 1 in the store before launching the
    collective, sees it go on into its backward, and raises a CollectiveError naming the call, its line and the
    rule, long before the timeout, on one line, once. Rank 1's collective then fails in one short line pointing to
    rank 0's error; the launcher's summary points to it too; the exit code is rank 0's, 1."""
    code, output = _skipped_run(call, tmp_path, timeout=UNREACHED_TIMEOUT)
    site = f"par.{call}() at {SCRIPTS / 'user_skipped.py'}:{_skipped_line(marker)}"
    diagnosis = f"paratrain.errors.CollectiveError: rank 0: {site} is a collective, called on rank 0 but not on every"
    assert code == 1, output
    assert output.count(site) == 1 and output.count(diagnosis) == 1, output
    line = next(line for line in output.splitlines() if line.startswith(diagnosis))
    assert "rank 1 went on without it: it launched the group's collective #" in line, line
    assert f"Every rank calls par.{call}() at the same point, not under a condition on the rank" in line, line
    assert "did not complete within" not in output and "hang report" not in output, output  # not the timeout's
    assert "collective mismatch" not in output and "SIGABRT" not in output, output  # not gloo's abort
    summary = next(line for line in output.splitlines() if line.startswith("paratrain launch: rank 0 exited"))
    assert summary.endswith(f"par.{call}() that not every rank called; the diagnosis is in rank 0's output above")
    peer = [line for line in output.splitlines() if line.startswith("paratrain.errors.CollectiveError: rank 1")]
    assert all(line.endswith("failed when rank 0 stopped; rank 0's error says why") for line in peer), peer


@pytest.mark.processes
def test_a_training_forward_only_rank_0_runs_under_zero3_is_named_with_its_lines_once(tmp_path):
    """Rank 0 runs a training forward (autograd on) before the step's forward, rank 1 does not: the extra forward's
    all-gathers pair silently with rank 1's forward (units of one size), and rank 0's next forward would pair with
    rank 1's backward. Rank 0, at one training forward more than its last backward followed, meets rank 1 first,
    sees it go on, and names both forwards' lines and the rule: once, long before the timeout."""
    code, output = _skipped_run("before", tmp_path, timeout=UNREACHED_TIMEOUT, script="user_zero3_forward.py")
    script = SCRIPTS / "user_zero3_forward.py"
    extra = f"{script}:{_skipped_line('training forward only rank 0 runs', script.name)}"
    step = f"{script}:{_skipped_line('loss = model(x).sum()', script.name)}"
    diagnosis = (
        f"paratrain.errors.CollectiveError: rank 0: a training forward (autograd on) that not every rank runs: rank 0 "
        f"ran 2 training forwards without a backward between them, at {extra}, then at {step}, while rank 1 ran fewer "
        f"and went on: it launched the group's collective #"
    )
    assert code == 1, output
    assert output.count(diagnosis) == 1 and output.count(extra) == 1, output
    assert "every rank runs the same forwards in the same order: evaluate under torch.no_grad() on every rank" in output
    assert "did not complete within" not in output and "hang report" not in output, output
    summary = next(line for line in output.splitlines() if line.startswith("paratrain launch: rank 0 exited"))
    assert summary.endswith("a training forward that not every rank ran; the diagnosis is in rank 0's output above")


@pytest.mark.slow
@pytest.mark.processes
def test_an_extra_training_forward_inside_the_step_is_named_and_forwards_every_rank_runs_are_not(tmp_path):
    """The extra forward between the step's forward and its backward is named the same way; a loop whose every rank
    runs a forward without a backward at every step (two training forwards a backward) meets once and finishes."""
    (tmp_path / "inside").mkdir()
    code, output = _skipped_run("inside", tmp_path / "inside", UNREACHED_TIMEOUT, "user_zero3_forward.py")
    script = SCRIPTS / "user_zero3_forward.py"
    extra = f"{script}:{_skipped_line('extra forward only rank 0 runs', script.name)}"
    assert code == 1 and output.count("ran 2 training forwards without a backward between them, at ") == 1, output
    assert f"then at {extra}, while rank 1 ran fewer and went on" in output, output
    (tmp_path / "none").mkdir()
    code, output = _skipped_run("none", tmp_path / "none", UNREACHED_TIMEOUT, "user_zero3_forward.py")
    assert code == 0 and "rank 0 finished" in output and "rank 1 finished" in output, output


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


def test_the_paratrain_call_and_the_users_line_are_read_from_the_live_frames():
    """What a meeting posts and a zero3 forward notes: the outermost paratrain frame's call, the user's line."""
    code = "def barrier():\n    return inner()\ndef inner():\n    return calling()\n"
    code += "def __exit__():\n    return calling()\n"
    namespace: dict = {"calling": calling}
    exec(compile(code, f"{PACKAGE_DIR}/parallel.py", "exec"), namespace)  # functions that live in paratrain's file
    line = sys._getframe().f_lineno + 1
    assert namespace["barrier"]() == ("par.barrier()", f"{__file__}:{line}")
    assert namespace["__exit__"]()[0] == "par.close()"  # the end of a `with Parallel(...)` block
    assert calling() == ("", "")  # outside paratrain
    lines = UserLine()
    namespace["lines"] = lines
    exec(compile("def forward():\n    return lines()\n", f"{PACKAGE_DIR}/x.py", "exec"), namespace)
    first = [namespace["forward"]() for _ in range(2)]  # walked, then looked up at the same depth
    assert first == [f"{__file__}:{sys._getframe().f_lineno - 1}"] * 2
    assert (lambda: namespace["forward"]())() == f"{__file__}:{sys._getframe().f_lineno}"  # another path: walked


def test_the_launchers_line_for_a_collective_error_is_its_short_summary():
    """The message holds the whole diagnosis, printed once by the rank; the launcher's summary quotes the pointer."""
    error = CollectiveError("rank 0: barrier (collective #1) did not complete within 3s: ...", summary="rank 0: short")
    assert error_line(error) == "CollectiveError: rank 0: short"
    assert error_line(ValueError("bad")) == "ValueError: bad"
