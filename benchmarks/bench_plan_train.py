"""Does `paratrain plan` predict the run a user then launches? plan's ddp:2 speed-up against `paratrain train`'s.

    .venv/bin/python benchmarks/bench_plan_train.py                  # SimpleNet and the 784-1024x3-10 MLP, 3 rounds
    .venv/bin/python benchmarks/bench_plan_train.py --rounds 5 --models simplenet

As a user would, with OMP_NUM_THREADS unset (each command picks its threads as it does for users): each round
runs `paratrain plan --max-world-size 2` on the model (global batch 256, digits60k), then `paratrain train` for
one epoch on one device and with `--strategy ddp --nproc-per-node 2`, in turn (the order alternating between
rounds), and compares plan's predicted speed-up of 2 processes with the measured ratio of train's samples/s.
The target is within 20% on a quiet machine; each row also gives the load average the runs saw and whether plan
called its own measurements unreliable, since on a shared machine the load, not the model, decides the error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import print_table, write_json

MODELS = {
    "simplenet": ["--model", "simplenet"],
    "mlp1024x3": ["--model", "mlp", "--width", "1024", "--depth", "3"],
}
COMMON = ["--batch-size", "256", "--dataset", "digits60k"]
TARGET = 0.20


def _paratrain(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # unset, as a user leaves it
    command = [sys.executable, "-m", "paratrain", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} exited with {done.returncode}:\n{done.stderr}")
    return done


def _train(model: list[str], ddp: bool, out: Path) -> dict:
    launch = ["--strategy", "ddp", "--nproc-per-node", "2"] if ddp else []
    _paratrain("train", *model, *COMMON, "--epochs", "1", "--quiet", *launch, "--metrics-out", str(out))
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results: dict[str, list[dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-plan-train-") as tmp:
        for round_ in range(args.rounds):
            for name in args.models:
                model = MODELS[name]
                report_path = Path(tmp) / "plan.json"
                _paratrain("plan", *model, *COMMON, "--max-world-size", "2", "--report-out", str(report_path))
                report = json.loads(report_path.read_text())
                order = [False, True] if round_ % 2 == 0 else [True, False]
                runs = {ddp: _train(model, ddp, Path(tmp) / f"m{int(ddp)}.json") for ddp in order}
                predicted = next(r["speedup"] for r in report["rows"] if r["world_size"] == 2)
                measured = runs[True]["samples_per_second"] / runs[False]["samples_per_second"]
                entry = {
                    "round": round_,
                    "predicted_speedup": predicted,
                    "measured_speedup": measured,
                    "error": predicted / measured - 1,
                    "plan_reliable": report["reliable"],
                    "plan_unreliable": report["unreliable"],
                    "single_samples_per_second": runs[False]["samples_per_second"],
                    "ddp_samples_per_second": runs[True]["samples_per_second"],
                    "threads": {"single": runs[False]["threads"], "ddp": runs[True]["threads"]},
                    "load_average": max(
                        x
                        for x in (report["inputs"]["load_average"], *(r["load_average"] for r in runs.values()))
                        if x is not None
                    ),
                    "cores": os.cpu_count(),
                }
                results.setdefault(name, []).append(entry)
                print(
                    f"round {round_ + 1} {name}: predicted x{predicted:.2f}, measured x{measured:.2f} "
                    f"({entry['error']:+.0%}), load {entry['load_average']:.1f}, plan "
                    f"{'reliable' if entry['plan_reliable'] else 'unreliable'}",
                    flush=True,
                )

    rows = []
    for name, rounds in results.items():
        errors = [r["error"] for r in rounds]
        rows.append(
            [
                name,
                f"x{statistics.median(r['predicted_speedup'] for r in rounds):.2f}",
                f"x{statistics.median(r['measured_speedup'] for r in rounds):.2f}",
                f"{statistics.median(errors):+.0%}",
                f"{min(errors):+.0%} .. {max(errors):+.0%}",
                f"{sum(abs(e) <= TARGET for e in errors)} of {len(errors)}",
                f"{sum(r['plan_reliable'] for r in rounds)} of {len(rounds)}",
                f"{max(r['load_average'] for r in rounds):.1f} / {rounds[0]['cores']}",
            ]
        )
    print()
    print_table(
        [
            "model",
            "plan ddp:2",
            "train ddp:2 / single",
            "median error",
            "range",
            f"within {TARGET:.0%}",
            "plan reliable",
            "max load / cores",
        ],
        rows,
    )
    print(f"\n{time.perf_counter() - started:.0f} s")
    write_json("plan_train", {"args": vars(args), "results": results}, args.out)


if __name__ == "__main__":
    main()
