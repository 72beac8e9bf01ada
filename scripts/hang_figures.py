"""How soon a hang is reported and the job ends: the fault matrix, each case run a few times, timed from the fault.

    python scripts/hang_figures.py                          # every case 3 times, --timeout 10, one job at a time
    python scripts/hang_figures.py --runs 5 --timeout 5 --cases sleep stop --out /tmp/hangs.json

Each run is a real job of two processes under ``paratrain launch`` running ``tests/scripts/user_hang.py``: at its
second step one rank sleeps, stops (SIGSTOP), loops in Python, exits, makes an all-reduce of its own the other
rank does not (``only0``), or both make all-reduces of different sizes (``shapes``). The clock starts when the
rank reaches the fault (the script prints the time) and stops when the hang report is written (its ``time``) and
when ``paratrain launch`` returns. The target: the job ends within timeout + 15 s of the fault.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_hang.py"
CASES = ("sleep", "stop", "loop", "kill", "only0", "shapes")


def run(case: str, timeout: float, workdir: Path) -> dict[str, object]:
    workdir.mkdir(parents=True)
    steps = "200" if case == "only0" else "60"
    command = [sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "2", str(SCRIPT)]
    command += ["--api", "parallel", "--fault", case, "--timeout", str(timeout), "--steps", steps]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=workdir)
    ended = time.time()
    output = done.stdout + done.stderr
    faults = [float(t) for t in re.findall(r"at fault ([\d.]+)", output)]
    fault = min(faults) if faults else float("nan")
    report_file = workdir / "paratrain-hang-report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    return {
        "case": case,
        "exit_code": done.returncode,
        "to_report": report["time"] - fault if report else None,
        "to_end": ended - fault,
        "reported_by": report["by"] if report else None,
        "rank1_state": next((r["state"] for r in report["ranks"] if r["rank"] == 1), None) if report else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", help="JSON path (default benchmarks/results/hang_figures.json)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="hang-figures-") as tmp:
        for r in range(args.runs):
            for case in args.cases:
                found = run(case, args.timeout, Path(tmp) / f"{case}-{r}")
                results.append(found)
                print(json.dumps(found), flush=True)
    print(f"\n{'case':8s}  {'to report (s)':>14s}  {'to end (s)':>11s}  {'target':>8s}  exit codes")
    for case in args.cases:
        mine = [x for x in results if x["case"] == case]
        reports = [float(x["to_report"]) for x in mine if x["to_report"] is not None]  # type: ignore[arg-type]
        ends = [float(x["to_end"]) for x in mine]  # type: ignore[arg-type]
        shown = f"{statistics.median(reports):.1f}" if reports else "-"
        print(
            f"{case:8s}  {shown:>14s}  {statistics.median(ends):>11.1f}  {args.timeout + 15:>8.0f}  "
            f"{sorted({x['exit_code'] for x in mine})}"
        )
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "hang_figures.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"timeout": args.timeout, "runs": args.runs, "results": results}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
