"""Does a finished job exit 0 every time? Runs real jobs many times and counts those that did not.

    python scripts/stress_exit.py        # 200 runs of a plain script (wrapper alive at exit), 100 of each other ending
    python scripts/stress_exit.py --runs 20 --other-runs 10 --train-runs 10   # shorter
    python scripts/stress_exit.py --train-runs 100 --runs 0   # paratrain train --strategy ddp only

Each probe run is `python -m torch.distributed.run --standalone --nproc-per-node 3 scripts/exit_probe.py --ending E`
(plain torchrun: the fix must hold for users' own scripts, not only behind paratrain's launcher); each train run
is `paratrain train --strategy ddp --nproc-per-node 3 --epochs 1 --quiet`. A run fails when it exits non-zero;
SIGABRTs ("terminate called") are counted apart. Prints a table and writes JSON (default
benchmarks/results/stress_exit.json). Long: minutes per hundred runs on a small machine; not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENDINGS = ("destroy", "no-destroy", "del-then-destroy")


def _run(command: list[str], timeout: float) -> tuple[int | str, bool, float]:
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timeout", False, time.monotonic() - started
    aborted = "terminate called" in done.stderr or "SIGABRT" in done.stderr
    return done.returncode, aborted, time.monotonic() - started


def _save(out: Path, procs: int, results: dict[str, dict[str, object]]) -> None:
    """Written after every case, so a run cut short still leaves the cases it finished."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"procs": procs, "results": results}, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="runs of the plain probe script (ending: destroy)")
    parser.add_argument("--other-runs", type=int, default=100, help="runs of each other ending of the probe")
    parser.add_argument("--train-runs", type=int, default=100, help="runs of paratrain train --strategy ddp")
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180, help="seconds one run may take")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stress_exit.json"))
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}"]
    cases = {
        f"probe, {ending}": (
            [*torchrun, "scripts/exit_probe.py", "--ending", ending],
            args.runs if ending == "destroy" else args.other_runs,
        )
        for ending in ENDINGS
    }
    train = [sys.executable, "-m", "paratrain", "train", "--strategy", "ddp", "--nproc-per-node", str(args.procs)]
    cases["paratrain train --strategy ddp"] = ([*train, "--epochs", "1", "--quiet"], args.train_runs)
    results: dict[str, dict[str, object]] = {}
    for name, (command, runs) in cases.items():
        codes: dict[str, int] = {}
        aborts, seconds = 0, 0.0
        for i in range(runs):
            code, aborted, took = _run(command, args.timeout)
            codes[str(code)] = codes.get(str(code), 0) + 1
            aborts += aborted
            seconds += took
            print(f"\r{name}: {i + 1}/{runs}", end="", flush=True)
        if runs:
            print()
        failed = runs - codes.get("0", 0)
        results[name] = {"runs": runs, "failed": failed, "aborts": aborts, "exit_codes": codes, "seconds": seconds}
        _save(Path(args.out), args.procs, results)
    print(f"\n{'case':<34}{'runs':>6}{'failed':>8}{'SIGABRT':>9}")
    for name, r in results.items():
        print(f"{name:<34}{r['runs']:>6}{r['failed']:>8}{r['aborts']:>9}")
    print(f"\nwrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
