"""How skewed are a ddp run's steps? The median step against the mean (the throughput train counts).

    .venv/bin/python benchmarks/bench_step_skew.py                      # SimpleNet and the 784-1024x3 MLP, ddp:2
    .venv/bin/python benchmarks/bench_step_skew.py --models simplenet --steps 100   # shorter

Each model runs ``--steps`` steps (after 5 warm-up steps) of bench's own loop (``paratrain.tools.bench.TimedSteps``:
the prepared model, loader, loss and optimizer of ``paratrain train``) under ddp in 2 processes started by torchrun,
global batch 256 of digits60k, as ``benchmarks/bench_plan_train.py`` runs them. Under ddp every rank waits for
the slowest rank's step, so a few steps are much slower than the rest; ``train``'s samples/s (samples over time)
includes them, a median leaves them out. This is why bench and plan take each repeat's mean step
(``paratrain.tools.bench.round_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import print_table, write_json

MODELS = {"simplenet": {"model": "simplenet"}, "mlp1024x3": {"model": "mlp", "width": 1024, "depth": 3}}


def _worker(name: str, steps: int, out: str) -> None:
    import paratrain
    from paratrain.tools.bench import BenchConfig, TimedSteps

    config = BenchConfig(**MODELS[name], batch_size=256, dataset="digits60k", configs=["ddp:2"])
    with paratrain.Parallel("ddp", "cpu") as par:
        loop = TimedSteps(par, config)
        for _ in range(5):
            loop.step()
        totals = [sum(loop.step().values()) for _ in range(steps)]
        if par.rank == 0:
            Path(out).write_text(json.dumps(totals))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS, reverse=True))
    parser.add_argument("--steps", type=int, default=600, help="timed steps per model (SimpleNet's take ~5 ms)")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "STEPS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return 0
    rows, found = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-step-skew-") as tmp:
        for name in args.models:
            steps = args.steps if name == "simplenet" else max(20, args.steps // 5)
            out = str(Path(tmp, f"{name}.json"))
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                       __file__, "--worker", name, str(steps), out]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            totals = json.loads(Path(out).read_text())
            median, mean = statistics.median(totals), statistics.fmean(totals)
            p90 = statistics.quantiles(totals, n=10)[-1]
            found[name] = {"steps": steps, "median_s": median, "mean_s": mean, "p90_s": p90, "max_s": max(totals)}
            rows.append([name, steps, f"{median * 1e3:.2f}", f"{mean * 1e3:.2f}", f"{mean / median - 1:+.0%}",
                         f"{p90 * 1e3:.2f}", f"{max(totals) * 1e3:.2f}"])  # fmt: skip
    print("ddp:2 over gloo, global batch 256, bench's step loop, rank 0's steps (ms):\n")
    print_table(["model", "steps", "median", "mean", "mean / median", "p90", "max"], rows)
    write_json("step_skew", {"settings": vars(args), "models": found}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
