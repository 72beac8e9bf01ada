"""How close is `paratrain plan` to what `paratrain bench` then measures? (the issue's target: within 15% for ddp:2)

    .venv/bin/python benchmarks/bench_plan.py                     # SimpleNet and the 10M MLP, 3 rounds each
    .venv/bin/python benchmarks/bench_plan.py --rounds 5 --models simplenet
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_plan.py  # one thread everywhere (steadier when shared)

Each round runs `plan --validate` (predict, then bench single and ddp:2/ddp:3 round robin) as a user would, and
records each configuration's prediction error (predicted / measured - 1). The sizes plan ran for real (up to
this machine's cores) are bench's own figures there; the sizes beyond check plan's extrapolation. The table
gives the median error and its spread (min..max) over the rounds, so one lucky round cannot stand for the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import print_table, write_json

from paratrain.tools import PlanConfig, plan

MODELS = {
    "simplenet": {"model": "simplenet"},
    "mlp": {"model": "mlp", "width": 2048, "depth": 2},  # 784-2048-2048-10: 5.8M parameters
    "mlp10m": {"model": "mlp", "width": 2048, "depth": 3},  # 784-2048x3-10: 10.0M parameters
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["simplenet", "mlp10m"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-world-size", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    results: dict[str, list[dict]] = {}
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for name in args.models:
            report = plan(
                PlanConfig(
                    **MODELS[name],
                    batch_size=args.batch_size,
                    max_world_size=args.max_world_size,
                    steps=args.steps,
                    repeats=args.repeats,
                    validate=True,
                )
            )
            entry = {"round": round_, "rows": [r.__dict__ for r in report.rows], "validation": report.validation}
            entry["parameters"] = report.inputs["parameters"]
            entry["inputs"] = report.inputs
            results.setdefault(name, []).append(entry)
            errors = {v["config"]: v.get("error") for v in report.validation}
            print(
                f"round {round_ + 1} {name}: " + ", ".join(f"{c} {e:+.1%}" for c, e in errors.items() if e is not None)
            )

    rows = []
    for name, rounds in results.items():
        configs = [v["config"] for v in rounds[0]["validation"]]
        for config in configs:
            errors = [next(v for v in r["validation"] if v["config"] == config).get("error") for r in rounds]
            errors = [e for e in errors if e is not None]
            predicted = [next(v for v in r["validation"] if v["config"] == config)["predicted_seconds"] for r in rounds]
            measured = [next(v for v in r["validation"] if v["config"] == config)["measured_seconds"] for r in rounds]
            rows.append(
                [
                    name,
                    f"{rounds[0]['parameters'] / 1e6:.1f}M",
                    config,
                    f"{statistics.median(predicted) * 1e3:.2f}",
                    f"{statistics.median(measured) * 1e3:.2f}",
                    f"{statistics.median(errors):+.1%}",
                    f"{min(errors):+.1%} .. {max(errors):+.1%}",
                    sum(abs(e) <= 0.15 for e in errors),
                ]
            )
    print()
    print_table(
        [
            "model",
            "params",
            "config",
            "predicted ms",
            "measured ms",
            "median error",
            "range",
            f"within 15% (of {args.rounds})",
        ],
        rows,
    )
    print(f"\n{time.perf_counter() - started:.0f} s")
    write_json("plan_validation", {"args": vars(args), "results": results}, args.out)


if __name__ == "__main__":
    main()
