"""Does paratrain's DistributedDataParallel keep up with torch's, and do its buckets use the bandwidth?

    python benchmarks/bench_ddp.py                  # world size 2 over gloo on this machine, a 10M-parameter MLP
    python benchmarks/bench_ddp.py --model gpt      # the same on a small GPT (3.7M parameters, 50 tensors)
    python benchmarks/bench_ddp.py --quick          # few repeats: a smoke run, not a measurement
    python benchmarks/bench_ddp.py --gpu            # world size 1 over nccl on cuda:0 against torch's DDP

The script starts its own worker processes. In every rank, with the same data and seed:

- step time (forward, backward with gradient averaging, SGD step) of torch's DDP, of paratrain's DDP, and of
  paratrain's DDP with overlap switched off (every bucket's all-reduce waits for the end of backward);
- bus bandwidth of paratrain's bucketed gradient all-reduce against one plain ``all_reduce`` of a flat buffer
  of the same size, busbw = 2 (n - 1) / n * bytes / seconds as nccl-tests define it.

Step time is measured two ways, because they disagree on a shared machine and a user sees the second:

- lockstep: a barrier, then one step, timed; the modes take turns step by step (what this script reported first);
- free-running: blocks of --block steps (default 5) with no barrier, the modes taking turns block by block, as
  a training loop runs (what a user's own timing of a loop sees: one rank's skew and anything a background
  thread costs show up here, and a barrier before every step hides them).

The workers meet in a TCP store hosted by this process, as torchrun's agent hosts it, so the store traffic of
paratrain's progress board crosses processes as it does under the launcher. The whole measurement repeats in
--invocations fresh sets of processes; the report gives every invocation's ratio and their median, min and max.
A fourth mode is paratrain's DDP without the drift check (each rank's collective numbers compared with a peer's
on the board's thread, docs/hangs.md): what that check costs a step. Targets: the median free-running step ratio
at most 1.0 (paratrain's DDP, with its fault detection on, no slower than torch's), the drift check within 1% of
the step, bucketed bandwidth at least 0.9 of flat.
"""

from __future__ import annotations

import argparse
import copy
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
from bench_common import print_table, sgd_step, write_json
from torch import nn

from paratrain.ddp.distributed import DistributedDataParallel

TARGET_STEP_RATIO = 1.0
TARGET_BANDWIDTH_RATIO = 0.9


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(784, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    backend = "nccl" if args.gpu else "gloo"
    device = torch.device("cuda", rank) if args.gpu else torch.device("cpu")
    if args.gpu:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, args.threads))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))  # the parent's
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    from bench_zero_modes import build_model, loss_of, make_batch  # it imports this module's mlp

    base = build_model(args.model, args.width, args.depth).to(device)
    params = sum(p.numel() for p in base.parameters())
    x, y = (t.to(device) for t in make_batch(args.model, args.batch, rank))
    ids = [device] if args.gpu else None
    modes: dict[str, nn.Module] = {
        "torch DDP": nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids),
        "paratrain DDP": DistributedDataParallel(copy.deepcopy(base), device_ids=ids),
        "paratrain DDP, no overlap": DistributedDataParallel(copy.deepcopy(base), device_ids=ids, _overlap=False),
        "paratrain DDP, no drift check": DistributedDataParallel(
            copy.deepcopy(base), device_ids=ids, _hang_checks=False
        ),
    }
    steps = {name: sgd_step(model, x, y, loss=loss_of) for name, model in modes.items()}
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    order = list(steps.items())
    for i in range(args.repeats):
        for name, step in order if i % 2 == 0 else order[::-1]:  # alternate the order: no seat is favoured
            samples[name].append(_timed(step, device))
    # free-running: blocks of steps with no barrier between steps or blocks, as a training loop runs
    blocks: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(args.blocks):
        for name, step in order if i % 2 == 0 else order[::-1]:
            _sync(device)
            start = time.perf_counter()
            for _ in range(args.block):
                step()
            _sync(device)
            blocks[name].append((time.perf_counter() - start) / args.block)

    # bandwidth: every bucket of our reducer, launched together, against one flat all-reduce of the same size
    ours = modes["paratrain DDP"]
    assert isinstance(ours, DistributedDataParallel)
    reducer = ours.reducer
    flat = torch.randn(sum(b.numel for b in reducer.buckets), device=device)
    bandwidth: dict[str, list[float]] = {"flat all_reduce": [], "paratrain buckets": []}
    for _ in range(args.warmup):
        dist.all_reduce(flat)
        reducer.reduce_buffers()
    ways: list[tuple[str, Callable[[], Any]]] = [
        ("flat all_reduce", lambda: dist.all_reduce(flat)),
        ("paratrain buckets", reducer.reduce_buffers),
    ]
    for i in range(args.repeats * 2):
        for name, fn in ways if i % 2 == 0 else ways[::-1]:  # alternate the order: no seat is favoured
            bandwidth[name].append(_timed(fn, device))
    result = {
        "params": params,
        "buckets": [{"index": b.index, "params": len(b.indices), "mb": b.nbytes / 2**20} for b in reducer.buckets],
        "bytes": flat.numel() * flat.element_size(),
        "steps": samples,
        "blocks": blocks,
        "bandwidth": bandwidth,
    }
    for model in modes.values():
        if isinstance(model, DistributedDataParallel):
            model.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _ratios(result: dict[str, Any]) -> dict[str, float]:
    """One invocation's ratios to torch's DDP: lockstep (median of barrier-started steps), free-running (median of
    blocks), and what overlapping the all-reduces with backward saves."""
    lock = {name: statistics.median(s) for name, s in result["steps"].items()}
    free = {name: statistics.median(s) for name, s in result["blocks"].items()}
    return {
        "lockstep": lock["paratrain DDP"] / lock["torch DDP"],
        "free_running": free["paratrain DDP"] / free["torch DDP"],
        "overlap_saves": 1 - free["paratrain DDP"] / free["paratrain DDP, no overlap"],
        "drift_check_costs": free["paratrain DDP"] / free["paratrain DDP, no drift check"] - 1,
        "torch_step_ms": free["torch DDP"] * 1e3,
    }


def report(results: list[dict[str, Any]], world: int, args: argparse.Namespace) -> dict[str, Any]:
    first = results[0]
    print(
        f"\nStep time, world size {world}, {args.model}, {first['params'] / 1e6:.1f}M parameters, batch {args.batch} "
        f"per rank, "
        f"{args.threads} thread(s) per rank; {len(results)} invocations, each {args.repeats} lockstep steps and "
        f"{args.blocks} blocks of {args.block} free-running steps per mode\n"
    )
    per_run = [_ratios(r) for r in results]
    rows = [
        [
            i + 1,
            r["torch_step_ms"],
            r["lockstep"],
            r["free_running"],
            100 * r["overlap_saves"],
            100 * r["drift_check_costs"],
        ]
        for i, r in enumerate(per_run)
    ]
    headers = ["invocation", "torch step ms", "lockstep ratio", "free-running ratio", "overlap saves %"]
    print_table([*headers, "drift check costs %"], rows)
    summary = {}
    for key in ("lockstep", "free_running", "drift_check_costs"):
        values = [r[key] for r in per_run]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}
    ratio = summary["free_running"]["median"]
    print(
        f"\nparatrain / torch DDP step time, median over invocations: free-running {ratio:.3f} "
        f"(min {summary['free_running']['min']:.3f}, max {summary['free_running']['max']:.3f}); lockstep "
        f"{summary['lockstep']['median']:.3f} (min {summary['lockstep']['min']:.3f}, max "
        f"{summary['lockstep']['max']:.3f}). Target: free-running median <= {TARGET_STEP_RATIO}: "
        f"{'PASS' if ratio <= TARGET_STEP_RATIO else 'FAIL'}"
    )

    nbytes = first["bytes"]
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    bandwidth = {name: [x for r in results for x in r["bandwidth"][name]] for name in first["bandwidth"]}
    busbw = {name: factor * nbytes / statistics.median(s) / 1e9 for name, s in bandwidth.items()}
    drift = summary["drift_check_costs"]["median"]
    print(f"the drift check costs {100 * drift:+.2f}% of paratrain's step, median over invocations (target < 1%)")
    bw_ratio = busbw["paratrain buckets"] / busbw["flat all_reduce"]
    print(f"\nGradient all-reduce of {nbytes / 2**20:.1f} MiB in {len(first['buckets'])} buckets\n")
    print_table(
        ["how", "median ms", "busbw GB/s"],
        [[name, statistics.median(s) * 1e3, busbw[name]] for name, s in bandwidth.items()],
    )
    print(
        f"\nbucketed / flat bandwidth {bw_ratio:.3f} (target >= {TARGET_BANDWIDTH_RATIO}): "
        f"{'PASS' if bw_ratio >= TARGET_BANDWIDTH_RATIO else 'FAIL'}"
    )
    return {
        "world_size": world,
        "backend": "nccl" if args.gpu else "gloo",
        "model": args.model,
        "params": first["params"],
        "batch_per_rank": args.batch,
        "threads_per_rank": args.threads,
        "invocations": len(results),
        "step_ratio_vs_torch": summary,
        "per_invocation": per_run,
        "busbw_gbps": busbw,
        "bandwidth_ratio": bw_ratio,
        "buckets": first["buckets"],
        "targets": {"free_running_step_ratio_max": TARGET_STEP_RATIO, "bandwidth_ratio_min": TARGET_BANDWIDTH_RATIO},
        "raw": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, help="processes (default 2 on CPU, 1 with --gpu)")
    parser.add_argument("--width", type=int, default=2048, help="hidden width (default 2048: about 10M parameters)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="the MLP, or the small GPT of "
        "bench_zero_modes.py (4 blocks, 256 wide, 64 tokens, tied head: 3.7M parameters)",
    )
    parser.add_argument("--batch", type=int, help="samples per rank per step (default: MLP 32, GPT 8 sequences)")
    parser.add_argument("--repeats", type=int, help="lockstep steps per mode (default 30; 4 with --quick)")
    parser.add_argument("--blocks", type=int, help="free-running blocks per mode (default 6; 2 with --quick)")
    parser.add_argument("--block", type=int, default=5, help="steps per free-running block (default 5)")
    parser.add_argument("--invocations", type=int, help="fresh sets of processes (default 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads per process (default: cores / world size)")
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run, not a measurement")
    parser.add_argument("--gpu", action="store_true", help="nccl on GPUs, world size 1 by default")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/ddp.json)")
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu asked for, but no GPU is visible", file=sys.stderr)
        return 2
    world = args.world_size or (1 if args.gpu else 2)
    args.batch = args.batch or (32 if args.model == "mlp" else 8)
    args.repeats = args.repeats or (4 if args.quick else 30)
    args.blocks = args.blocks or (2 if args.quick else 6)
    invocations = args.invocations or (1 if args.quick else 5)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    results = []
    for _ in range(invocations):
        # the store the workers meet in lives here, as torchrun's agent hosts it for its workers
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rank0.json")
            mp.start_processes(worker, args=(world, store.port, args, out), nprocs=world, start_method="spawn")
            results.append(json.loads(Path(out).read_text()))
        del store
    payload = report(results, world, args)
    name = "ddp_gpu" if args.gpu else "ddp"
    write_json(name if args.model == "mlp" else f"{name}_{args.model}", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
