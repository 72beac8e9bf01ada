"""What does gradient accumulation cost under ddp, at the same global batch per optimizer step?

    python benchmarks/bench_accumulate.py            # 2 processes over gloo, MLP 784-1024x2-10, global batch 256
    python benchmarks/bench_accumulate.py --quick    # few repeats: a smoke run, not a measurement
    python benchmarks/bench_accumulate.py --batch 64      # micro-batches of 8 per rank: communication weighs more
    python benchmarks/bench_accumulate.py --steps 8 --batch 512 --world-size 2

The script starts its own worker processes. Each times one optimizer step on the same global batch (each rank
holding its share, as a prepared loader gives it) in three modes, all through ``Parallel("ddp")``:

- ``K=1``: one forward and backward over the share, one gradient all-reduce round;
- ``K=4, accumulate``: ``par.accumulate(model, batch, steps=4)``: four micro-batches, the first three under
  ``no_sync``, one all-reduce round at the last;
- ``K=4, sync every micro-batch``: the same four micro-batches with every backward synchronising (what
  accumulation without ``no_sync`` does), to show what ``no_sync`` saves;
- ``K=4, torch DDP no_sync``: the same four micro-batches through ``torch.nn.parallel.DistributedDataParallel``
  with its ``no_sync()``, written by hand: what accumulation costs in torch itself, the reference for ours.

The modes run interleaved, one step each in turn with the order alternating, after a warm-up; figures are
medians of the repeats, measured on rank 0 from a barrier to the end of its step (every mode's last backward
all-reduces, which holds rank 0 until every rank has got there; a trailing barrier would add gloo's barrier
latency, tens of milliseconds on a loaded machine, to every mode). Beside the wall clock, the CPU time rank 0's
process spent in the step (all its threads, gloo's included): on a machine shared with other jobs, where the
wall clock mostly measures waiting for a core, it still says how much work each mode does.
"""

from __future__ import annotations

import argparse
import contextlib
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
from torch.nn import functional as F

import paratrain
from paratrain.loop.accumulation import cut, micro_sizes
from paratrain.training.models import MLP


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, args.threads))
    # a file store: no port to pick, so nothing else on the machine can take it first
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    par = paratrain.Parallel("ddp", "cpu")
    g = torch.Generator().manual_seed(1)
    global_batch = (torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
    k = args.steps

    def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = par.prepare(MLP(784, 10, width=args.width, depth=args.depth))
        optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=0.01))
        (batch,) = list(par.prepare([global_batch]))  # this rank's share, recorded like any loader's
        return model, optimizer, batch

    def accumulated(steps: int) -> Callable[[], None]:
        model, optimizer, batch = setup()

        def step() -> None:
            for x, y in par.accumulate(model, batch, steps=steps):
                par.backward(F.cross_entropy(model(x), y))
            par.step(optimizer)
            optimizer.zero_grad()

        return step

    def synchronising_every_micro_batch() -> Callable[[], None]:
        model, optimizer, batch = setup()
        pieces = cut(batch, micro_sizes(len(batch[1]), args.batch, k))

        def step() -> None:
            for x, y in pieces:
                par.backward(F.cross_entropy(model(x), y))  # outside no_sync: every backward all-reduces
            par.step(optimizer)
            optimizer.zero_grad()

        return step

    def torch_ddp_no_sync() -> Callable[[], None]:
        _model, _optimizer, batch = setup()
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(MLP(784, 10, width=args.width, depth=args.depth))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sizes = micro_sizes(len(batch[1]), args.batch, k)
        pieces = cut(batch, sizes)
        weights = [n * world / args.batch for n in sizes]  # as paratrain weighs them: the global batch's mean

        def step() -> None:
            for j, ((x, y), weight) in enumerate(zip(pieces, weights, strict=True)):
                with model.no_sync() if j + 1 < len(pieces) else contextlib.nullcontext():
                    (F.cross_entropy(model(x), y) * weight).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    modes = {
        "K=1": accumulated(1),
        f"K={k}, accumulate": accumulated(k),
        f"K={k}, sync every micro-batch": synchronising_every_micro_batch(),
        f"K={k}, torch DDP no_sync": torch_ddp_no_sync(),
    }
    for _ in range(args.warmup):
        for step in modes.values():
            step()
    wall: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    order = list(modes.items())
    for i in range(args.repeats):
        for name, step in order if i % 2 == 0 else order[::-1]:  # alternate the order: no seat is favoured
            dist.barrier()  # a common start; the step's last all-reduce brings the ranks together again
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    par.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": wall, "cpu": cpu}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="hidden width (default 1024: paratrain's mlp)")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256, help="global batch per optimizer step (default 256)")
    parser.add_argument("--steps", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--repeats", type=int, help="timed steps per mode (default 30; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads per process (default: cores / world size)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/accumulate.json)")
    args = parser.parse_args(argv)
    world = args.world_size
    args.repeats = args.repeats or (3 if args.quick else 30)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.start_processes(
            worker, args=(world, str(Path(tmp) / "store"), args, out), nprocs=world, start_method="spawn"
        )
        samples = json.loads(Path(out).read_text())
    medians = {name: statistics.median(s) for name, s in samples["wall"].items()}
    cpu = {name: statistics.median(s) for name, s in samples["cpu"].items()}
    base, cpu_base = medians["K=1"], cpu["K=1"]
    print(
        f"\nOne optimizer step under ddp, world size {world} over gloo ({args.threads} threads each), "
        f"MLP 784-{args.width}x{args.depth}-10, global batch {args.batch}, median of {args.repeats}\n"
    )
    best = {name: min(s) for name, s in samples["wall"].items()}
    print_table(
        ["mode", "median ms", "samples/s", "vs K=1", "best ms", "CPU ms", "CPU vs K=1"],
        [
            [name, t * 1e3, args.batch / t, t / base, best[name] * 1e3, cpu[name] * 1e3, cpu[name] / cpu_base]
            for name, t in medians.items()
        ],
    )
    write_json(
        "accumulate",
        {
            "world_size": world,
            "backend": "gloo",
            "threads_per_process": args.threads,
            "model": f"MLP 784-{args.width}x{args.depth}-10",
            "global_batch": args.batch,
            "micro_batches": args.steps,
            "repeats": args.repeats,
            "step_ms": {name: t * 1e3 for name, t in medians.items()},
            "ratio_vs_k1": {name: t / base for name, t in medians.items()},
            "best_step_ms": {name: t * 1e3 for name, t in best.items()},
            "cpu_ms_rank0": {name: t * 1e3 for name, t in cpu.items()},
            "cpu_ratio_vs_k1": {name: t / cpu_base for name, t in cpu.items()},
            "raw_seconds": samples,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
