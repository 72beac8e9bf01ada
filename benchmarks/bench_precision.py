"""What does mixed precision buy in samples per second, against float32 in the same run?

    python benchmarks/bench_precision.py                  # the CPU: MLP 784-1024x2-10, batch 256, median of 30
    python benchmarks/bench_precision.py --gpu            # cuda:0, same model and batch
    python benchmarks/bench_precision.py --quick          # few repeats: a smoke run, not a measurement
    python benchmarks/bench_precision.py --width 4096 --batch 512 --threads 1

Each mode is the training step a loop through ``Parallel`` runs (single device): forward under the precision's
autocast, cross-entropy in float32, ``par.backward`` (with ``16-mixed``: the scaled loss), ``par.step`` (with
``16-mixed``: unscale, inf/nan check, scale update), ``zero_grad``. Parameters, gradients and optimizer state
stay float32 in every mode, so the difference is the forward and backward arithmetic and autocast's casts.
Modes run interleaved, one step each in turn with the order alternating, after a warm-up; figures are medians.
float32 is the baseline; ratios above 1 mean faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from bench_common import print_table, sync, write_json
from torch.nn import functional as F

import paratrain
from paratrain.loop.precision import PRECISIONS
from paratrain.training.models import MLP


def make_step(precision: str, device: str, args: argparse.Namespace) -> Any:
    """One training step of a fresh MLP (the same initial weights in every mode) through Parallel."""
    par = paratrain.Parallel("single", device, precision=precision)
    torch.manual_seed(0)
    model = par.prepare(MLP(784, 10, width=args.width, depth=args.depth))
    optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 784, generator=g).to(par.device)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(par.device)

    def step() -> None:
        par.backward(F.cross_entropy(model(x), y))
        par.step(optimizer)
        optimizer.zero_grad()

    return par, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="run on cuda:0")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: paratrain's mlp)")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (default 2)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, help="timed steps per mode (default 30; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/precision[_gpu].json)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu asked for, but no GPU is visible", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (3 if args.quick else 30)
    device = "cuda:0" if args.gpu else "cpu"

    steps, parallels = {}, []
    for precision in PRECISIONS:
        par, step = make_step(precision, device, args)
        steps[precision] = step
        parallels.append(par)
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for i in range(args.repeats):
        for name, step in order if i % 2 == 0 else order[::-1]:  # alternate the order: no seat is favoured
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    for par in parallels:
        par.close()

    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["32"]
    params = sum(p.numel() for p in MLP(784, 10, width=args.width, depth=args.depth).parameters())
    print(
        f"\nTraining step on {device} ({torch.get_num_threads()} threads), MLP 784-{args.width}x{args.depth}-10 "
        f"({params / 1e6:.1f}M parameters), batch {args.batch}, median of {args.repeats}\n"
    )
    best = {name: min(s) for name, s in samples.items()}
    rows = [[name, t * 1e3, args.batch / t, base / t, best[name] * 1e3] for name, t in medians.items()]
    print_table(["precision", "median ms", "samples/s", "vs 32", "best ms"], rows)
    write_json(
        "precision_gpu" if args.gpu else "precision",
        {
            "device": device,
            "threads": torch.get_num_threads(),
            "model": f"MLP 784-{args.width}x{args.depth}-10",
            "params": params,
            "batch": args.batch,
            "repeats": args.repeats,
            "step_ms": {name: t * 1e3 for name, t in medians.items()},
            "samples_per_s": {name: args.batch / t for name, t in medians.items()},
            "speedup_vs_32": {name: base / t for name, t in medians.items()},
            "best_step_ms": {name: t * 1e3 for name, t in best.items()},
            "raw_seconds": samples,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
