"""Are zero1 and zero2 as fast as our DDP? Step time at world size 2, and the communication a step exposes.

    python benchmarks/bench_zero_speed.py              # 2 processes over gloo, the 10M-parameter MLP, fp32 AdamW
    python benchmarks/bench_zero_speed.py --quick      # few repeats: a smoke run, not a measurement

In every rank, with the same model, data and seed, four modes take turns block by block (--block steps each, the
order rotating every round, a barrier before each block so that both ranks start it together):

- local: the plain model and AdamW, no communication at all: the compute a step needs (the baseline);
- ddp: paratrain's DistributedDataParallel (gradients all-reduced in buckets during backward);
- zero1: ZeroDataParallel(stage=1): ddp's all-reduce, each rank updating its half, the weights all-gathered;
- zero2: ZeroDataParallel(stage=2): each bucket reduce-scattered during backward, the weights all-gathered.

Each mode's step time is the median over blocks of a block's seconds per step (rank 0's; the ranks wait for each
other in every collective). Exposed communication is a mode's step minus local's: what the collectives add to the
step beyond what backward hides. The target is zero1 and zero2 within 1.05x of ddp. On a CPU machine the two
processes share its cores and the collectives compete with compute for them, so the figures move between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import print_table, write_json
from bench_ddp import mlp  # the 784-WIDTHxDEPTH-10 MLP bench_ddp times
from torch import nn

from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.sharded.optimizer import shard_optimizer
from paratrain.sharded.zero import ZeroDataParallel

MODES = ("local", "ddp", "zero1", "zero2")
TARGET_RATIO = 1.05


def stepper(mode: str, width: int, depth: int, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    net = mlp(width, depth)
    model: nn.Module
    if mode == "local":
        model = net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    elif mode == "ddp":
        model = DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model = ZeroDataParallel(net, stage=int(mode[-1]))
        opt = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = f"file://{store}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    steps = {mode: stepper(mode, args.width, args.depth, x, y) for mode in MODES}
    for mode in MODES:  # warm-up: every mode's first steps (allocations, the first all-gathers) go untimed
        dist.barrier()
        for _ in range(2):
            steps[mode]()
    blocks: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.repeats):
        shift = round_ % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                steps[mode]()
            blocks[mode].append((time.perf_counter() - start) / args.block)
    Path(out, f"rank{rank}.json").write_text(json.dumps(blocks))
    dist.barrier()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=10, help="blocks per mode")
    parser.add_argument("--quick", action="store_true", help="3 blocks of 2 steps: a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.block = 3, 2
    world = 2
    with tempfile.TemporaryDirectory(prefix="bench-zero-speed-") as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", args, tmp), nprocs=world, start_method="spawn")
        blocks = json.loads(Path(tmp, "rank0.json").read_text())
    medians = {mode: statistics.median(samples) for mode, samples in blocks.items()}
    local, ddp = medians["local"], medians["ddp"]
    params = sum(p.numel() for p in mlp(args.width, args.depth).parameters())
    rows: list[list[Any]] = []
    for mode in MODES:
        m = medians[mode]
        rows.append(
            [
                mode,
                f"{m * 1e3:.1f}",
                f"{min(blocks[mode]) * 1e3:.1f}..{max(blocks[mode]) * 1e3:.1f}",
                "-" if mode == "local" else f"{(m - local) * 1e3:.1f}",
                "-" if mode == "local" else f"{m / ddp:.3f}x",
            ]
        )
    print(f"world size 2 over gloo, MLP {params / 1e6:.1f}M parameters, fp32 AdamW, batch {args.batch} per rank;")
    print(f"medians of {args.repeats} blocks of {args.block} steps (rank 0)\n")
    print_table(["mode", "step ms", "range ms", "exposed comm ms", "vs ddp"], rows)
    within = {mode: medians[mode] / ddp <= TARGET_RATIO for mode in ("zero1", "zero2")}
    verdict = ", ".join(
        f"{mode} {'within' if ok else 'NOT within'} {TARGET_RATIO}x of ddp" for mode, ok in within.items()
    )
    print(f"\n{verdict}")
    payload = {
        "settings": vars(args),
        "params": params,
        "world_size": world,
        "median_step_seconds": medians,
        "block_step_seconds": blocks,
        "exposed_comm_seconds": {mode: medians[mode] - local for mode in MODES if mode != "local"},
        "ratio_to_ddp": {mode: medians[mode] / ddp for mode in MODES},
        "target_ratio": TARGET_RATIO,
        "within_target": within,
    }
    write_json("bench_zero_speed", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
