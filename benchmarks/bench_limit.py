"""How near the limit is the main job? Its step against the matrix multiplications it cannot do without.

    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py                 # 3 rounds of one epoch each, one thread
    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py --rounds 5 --profile-steps 300 --out /tmp/limit.json

The bound is the time of the forward and weight-gradient matrix multiplications of SimpleNet at batch 64 (the
784x256 and 256x10 layers: two ``addmm`` forward, two ``mm`` for the weight gradients), timed in this process
between the configurations' epochs; its samples/s is what the step would reach if everything else were free.
Each configuration's share of it is ``bound seconds / step seconds``:

- ``hand``: a plain torch loop on tensor batches (one ``index_select`` per batch), torch's SGD;
- ``train``: ``paratrain train --strategy single`` in this process (its training samples/s);
- ``prepare``: a ``DataLoader(TensorDataset)`` loop through ``Parallel.prepare``.

Target: ``train`` at least 0.75 of the bound. Then one profiled run of ``train``'s steps (torch.profiler, self CPU
time by operator, as shares of that run's training time) says where the step goes: the matrix multiplications
(slower inside the step than alone: the step's other tensors share the caches), reading the batch, the optimizer,
the elementwise and loss operators, autograd's own operators, and Python and dispatch between operators (the
rest). The profiler adds its own cost to every operator: read the shares as proportions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead
from bench_common import print_table, write_json

BATCH = 64
TARGET = 0.75
CATEGORIES = {  # operator name -> where its time goes
    "matmul": ("aten::mm", "aten::addmm"),
    "batch": ("aten::index_select",),
    "optimizer": ("Optimizer.step", "aten::add_", "aten::_foreach_add_", "aten::_fused_sgd_"),
    "elementwise and loss": (
        "aten::relu", "aten::clamp_min", "aten::threshold_backward", "aten::_log_softmax",
        "aten::_log_softmax_backward_data", "aten::nll_loss_forward", "aten::nll_loss_backward", "aten::sum",
        "aten::copy_", "aten::fill_",
    ),
}  # fmt: skip


def bound_seconds(blocks: int = 20, per_block: int = 20) -> float:
    """Seconds of SimpleNet's forward and weight-gradient matmuls at batch 64 (median of blocks)."""
    g = torch.Generator().manual_seed(0)
    x, w1, b1 = torch.randn(BATCH, 784, generator=g), torch.randn(256, 784, generator=g), torch.randn(256, generator=g)
    h, w2, b2 = torch.randn(BATCH, 256, generator=g), torch.randn(10, 256, generator=g), torch.randn(10, generator=g)
    g1, g2 = torch.randn(BATCH, 256, generator=g), torch.randn(BATCH, 10, generator=g)

    def matmuls() -> None:
        torch.addmm(b1, x, w1.t())  # fc1 forward
        torch.addmm(b2, h, w2.t())  # fc2 forward
        g1.t().mm(x)  # fc1 weight gradient
        g2.t().mm(h)  # fc2 weight gradient

    for _ in range(per_block):
        matmuls()
    samples = []
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(per_block):
            matmuls()
        samples.append((time.perf_counter() - started) / per_block)
    return statistics.median(samples)


def profile_train_steps(steps: int) -> dict[str, float]:
    """Where ``steps`` steps of paratrain train spend their time, as shares of the profiled run's wall clock."""
    from torch.profiler import ProfilerActivity, profile

    from paratrain.training import TrainConfig, train

    config = TrainConfig(
        dataset="digits60k", epochs=1, strategy="single", devices="cpu", quiet=True, max_steps=steps, log_every=10**9
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = train(config)
    wall = result.train_seconds
    totals = dict.fromkeys([*CATEGORIES, "autograd's own operators"], 0.0)
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if not event.key.startswith(("aten::", "Optimizer.", "autograd::", "torch::autograd")):
            continue
        category = next(
            (c for c, names in CATEGORIES.items() if event.key.startswith(names)), "autograd's own operators"
        )
        totals[category] += seconds
    totals["Python and dispatch between operators"] = max(wall - sum(totals.values()), 0.0)
    return {k: v / wall for k, v in totals.items()} if wall else totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=200, help="steps of train profiled (0: none)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/bench_limit.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = {
        "hand": lambda: bench_overhead._hand(False),
        "train": lambda: bench_overhead._train(False, "single"),
        "prepare": lambda: bench_overhead._prepare(False),
    }
    for run in configs.values():  # warm: the first epoch of each pays one-off costs
        run()
    rates: dict[str, list[float]] = {name: [] for name in configs}
    bounds: list[float] = []
    for r in range(args.rounds):
        names = list(configs)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            bounds.append(bound_seconds())
            rates[name].append(configs[name]())
        bounds.append(bound_seconds())
    bound = statistics.median(bounds)
    bound_rate = BATCH / bound
    rows, results = [], {}
    for name, values in rates.items():
        rate = statistics.median(values)
        share = bound * rate / BATCH  # bound seconds over step seconds
        results[name] = {"samples_per_second": rate, "step_seconds": BATCH / rate, "bound_share": share}
        rows.append([name, rate, f"{BATCH / rate * 1e6:.0f}", share, "" if name != "train" else share >= TARGET])
    print(f"bound: the matmuls alone take {bound * 1e6:.0f} us per step of 64 = {bound_rate:,.0f} samples/s "
          f"(median of {len(bounds)}, from {min(bounds) * 1e6:.0f} to {max(bounds) * 1e6:.0f} us)")  # fmt: skip
    print_table(["configuration", "samples/s", "step us", "share of bound", f"met (>= {TARGET})"], rows)
    breakdown: dict[str, Any] = {}
    if args.profile_steps:
        breakdown = profile_train_steps(args.profile_steps)
        print(
            f"\nwhere train's step goes ({args.profile_steps} profiled steps: operators' self CPU time, and the rest)"
        )
        print_table(["category", "share"], [[k, f"{v:.1%}"] for k, v in breakdown.items()])
    write_json(
        "bench_limit",
        {"rounds": args.rounds, "bound_seconds": bound, "bounds": bounds, "configs": results, "rates": rates,
         "target": TARGET, "breakdown": breakdown},
        args.out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
