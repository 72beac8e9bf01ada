"""Does `paratrain plan` predict the run a user then launches? plan against `paratrain train` at each measured size.

    .venv/bin/python benchmarks/bench_plan_train.py                  # SimpleNet and the 784-1024x3-10 MLP, 3 rounds
    .venv/bin/python benchmarks/bench_plan_train.py --rounds 5 --models simplenet --max-world-size 3
    .venv/bin/python benchmarks/bench_plan_train.py --threads 1     # OMP_NUM_THREADS=1 for plan and train alike

As a user would, with OMP_NUM_THREADS unset (each command picks its threads as it does for users; `--threads N`
sets it for every process of both, as a user may): each round runs `paratrain plan --max-world-size N` on the
model (global batch 256, digits60k; plan runs the real strategy at the sizes this machine can run, up to its
cores, and extrapolates the rest), then, right after it, `paratrain
train` on one device and with `--strategy ddp --nproc-per-node n` for every size plan measured, each size twice
in the order ABBA (single, ddp:2, ddp:2, single), so that load drifting during the round hits every size alike;
train's figure at a size is the mean of its two runs' samples/s. Each train run is one epoch (40 steps for the
4096-wide MLP; 4 epochs of SimpleNet, whose step is about a millisecond, so that the epoch's first steps and the
load of one moment weigh less). The round compares plan's speed-up at each measured size with the ratio of
train's samples/s there; the table gives the median over rounds, the range and how many rounds were within.
The target is within 20% at every measured size; each row also gives the load average the runs saw and whether
plan called its own measurements unreliable, since on a shared machine the load, not the model, decides the
error. Extrapolated sizes are listed with plan's fit error, not compared (this machine cannot run them).
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
    "mlp4096x4": ["--model", "mlp", "--width", "4096", "--depth", "4", "--optimizer", "adamw"],
}
TRAIN_STEPS = {"mlp4096x4": 40}  # one epoch of the rest; the 4096-wide MLP's is too long (train stops at N steps)
TRAIN_EPOCHS = {"simplenet": 4}  # a step of about 1 ms: one epoch (234 steps) is a fraction of a second
COMMON = ["--batch-size", "256", "--dataset", "digits60k"]
TARGET = 0.20


def _paratrain(*args: str, threads: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # unset, as a user leaves it
    if threads is not None:  # --threads: every process of plan and train at this many
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "paratrain", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} exited with {done.returncode}:\n{done.stderr}")
    return done


def _train(name: str, world_size: int, out: Path, threads: int | None) -> dict:
    launch = ["--strategy", "ddp", "--nproc-per-node", str(world_size)] if world_size > 1 else []
    limit = ["--max-steps", str(TRAIN_STEPS[name])] if name in TRAIN_STEPS else []
    epochs = str(TRAIN_EPOCHS.get(name, 1))
    metrics = ["--metrics-out", str(out)]
    flags = ["--epochs", epochs, *limit, "--quiet", *launch, *metrics]
    _paratrain("train", *MODELS[name], *COMMON, *flags, threads=threads)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["simplenet", "mlp1024x3"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-world-size", type=int, default=2, help="plan's --max-world-size")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for every process of plan and train (default: unset, as a user leaves it; 1 keeps a "
        "loaded machine's spinning OpenMP threads out of the comparison)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results: dict[str, list[dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-plan-train-") as tmp:
        for round_ in range(args.rounds):
            for name in args.models:
                report_path = Path(tmp) / "plan.json"
                plan_started = time.perf_counter()
                plan_args = ["plan", *MODELS[name], *COMMON, "--max-world-size", str(args.max_world_size)]
                _paratrain(*plan_args, "--quiet", "--report-out", str(report_path), threads=args.threads)
                plan_seconds = time.perf_counter() - plan_started
                report = json.loads(report_path.read_text())
                rows = {r["world_size"]: r for r in report["rows"]}
                sizes = [n for n, r in rows.items() if r["source"] == "measured"]
                order = sizes + sizes[::-1]  # ABBA: drift during the round hits every size alike
                train: dict[int, list[dict]] = {}
                for i, n in enumerate(order):
                    train.setdefault(n, []).append(_train(name, n, Path(tmp) / f"m{n}-{i}.json", args.threads))
                speed = {n: statistics.mean(r["samples_per_second"] for r in train[n]) for n in sizes}
                sizes_out = {}
                for n in sizes[1:]:
                    measured = speed[n] / speed[1]
                    sizes_out[n] = {
                        "predicted_speedup": rows[n]["speedup"],
                        "measured_speedup": measured,
                        "error": rows[n]["speedup"] / measured - 1,
                        "samples_per_second": speed[n],
                        "samples_per_second_runs": [r["samples_per_second"] for r in train[n]],
                        "single_samples_per_second_runs": [r["samples_per_second"] for r in train[1]],
                        "plan_step_seconds": rows[n]["step_seconds"],
                        "plan_single_step_seconds": rows[1]["step_seconds"],
                        "threads": train[n][0]["threads"],
                    }
                loads = [r["load_average"] for v in train.values() for r in v]
                entry = {
                    "round": round_,
                    "plan_seconds": plan_seconds,
                    "sizes": sizes_out,
                    "extrapolated": {
                        n: {"speedup": r["speedup"], "source": r["source"]}
                        for n, r in rows.items()
                        if r["source"] != "measured"
                    },
                    "model_error_before_fit": report["inputs"].get("model_error_before_fit", {}),
                    "plan_reliable": report["reliable"],
                    "plan_unreliable": report["unreliable"],
                    "single_samples_per_second": speed[1],
                    "load_average": max(x for x in (report["inputs"]["load_average"], *loads) if x is not None),
                    "cores": os.cpu_count(),
                }
                results.setdefault(name, []).append(entry)
                said = ", ".join(
                    f"ddp:{n} plan x{v['predicted_speedup']:.2f} train x{v['measured_speedup']:.2f} "
                    f"({v['error']:+.0%}{'' if abs(v['error']) <= TARGET else ' MISSES'})"
                    for n, v in sizes_out.items()
                )
                print(
                    f"round {round_ + 1} {name}: {said}; plan took {plan_seconds:.0f} s, load "
                    f"{entry['load_average']:.1f}, plan {'reliable' if entry['plan_reliable'] else 'unreliable'}",
                    flush=True,
                )

    rows_out = []
    for name, rounds in results.items():
        for n in sorted({n for r in rounds for n in r["sizes"]}):
            at = [r["sizes"][n] for r in rounds if n in r["sizes"]]
            errors = [v["error"] for v in at]
            within = sum(abs(e) <= TARGET for e in errors)
            rows_out.append(
                [
                    name,
                    f"ddp:{n}",
                    f"x{statistics.median(v['predicted_speedup'] for v in at):.2f}",
                    f"x{statistics.median(v['measured_speedup'] for v in at):.2f}",
                    f"{statistics.median(errors):+.0%}",
                    f"{min(errors):+.0%} .. {max(errors):+.0%}",
                    f"{within} of {len(errors)}",
                    "WITHIN" if abs(statistics.median(errors)) <= TARGET else "MISSES",
                    f"{sum(r['plan_reliable'] for r in rounds)} of {len(rounds)}",
                    f"{statistics.median(r['plan_seconds'] for r in rounds):.0f} s",
                    f"{max(r['load_average'] for r in rounds):.1f} / {rounds[0]['cores']}",
                ]
            )
    print()
    print_table(
        [
            "model",
            "size",
            "plan",
            "train ddp:n / single",
            "median error",
            "range",
            f"rounds within {TARGET:.0%}",
            "verdict (median)",
            "plan reliable",
            "plan took",
            "max load / cores",
        ],
        rows_out,
    )
    print(f"\n{time.perf_counter() - started:.0f} s")
    write_json("plan_train", {"args": vars(args), "results": results}, args.out)


if __name__ == "__main__":
    main()
