"""Where zero1's and zero2's step goes, phase by phase, beside ddp's; and what one all-gather of the weights costs.

    .venv/bin/python benchmarks/bench_zero_phases.py --model gpt      # the small GPT (bench_zero_modes.py's)
    .venv/bin/python benchmarks/bench_zero_phases.py                  # the 10M MLP
    .venv/bin/python benchmarks/bench_zero_phases.py --quick          # a smoke run

In two gloo processes, the modes take turns block by block (5 steps a block, the first block of each mode
untimed); each step is timed in four phases: zero_grad, forward (with the loss), backward, optimizer step. The
forward's "waiting" column is the time its collectives were waited for (zero1's and zero2's step waits for its
all-gathers of the updated weights, so a forward waits for none). Medians over the timed steps, rank 0.

Beside it, in both ranks: all-gathering a buffer of the model's size (the weights' all-gather of one step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import print_table, write_json
from bench_zero_modes import add_model_arguments, build_mode, build_model, default_batch, loss_of, make_batch

from paratrain.comm.ops import GroupOps

PHASE_NAMES = ("zero_grad", "forward", "waiting", "backward", "step", "total")


def _phases(args: argparse.Namespace, rank: int) -> dict[str, dict[str, float]]:
    x, y = make_batch(args.model, args.batch, rank)
    built = {m: build_mode(m, args.model, args.width, args.depth) for m in args.modes}
    times: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PHASE_NAMES} for m in args.modes}
    for block in range(args.blocks + 1):
        for m in args.modes:
            mode = built[m]
            monitor = getattr(mode.model, "monitor", None)
            for _ in range(args.block):
                t0 = time.perf_counter()
                mode.optimizer.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                waited = monitor.waited if monitor is not None else 0.0
                loss = loss_of(mode.model(x), y)
                t2 = time.perf_counter()
                waiting = (monitor.waited - waited) if monitor is not None else 0.0
                loss.backward()
                t3 = time.perf_counter()
                mode.optimizer.step()
                t4 = time.perf_counter()
                if block:  # the first block of each mode warms it up
                    spent = (t1 - t0, t2 - t1, waiting, t3 - t2, t4 - t3, t4 - t0)
                    for name, value in zip(PHASE_NAMES, spent, strict=True):
                        times[m][name].append(value)
    return {m: {p: statistics.median(v) for p, v in phases.items()} for m, phases in times.items()}


def _gathers(args: argparse.Namespace, rank: int) -> dict[str, float]:
    numel = sum(p.numel() for p in build_model(args.model, args.width, args.depth).parameters()) // 2 * 2
    buffer, part = torch.zeros(numel), numel // 2
    own = buffer.narrow(0, rank * part, part)
    ops = GroupOps(None, buffer.device)
    spent: list[float] = []
    for i in range(args.gather_repeats + 3):
        dist.barrier()
        t = time.perf_counter()
        ops.all_gather(buffer, own).wait()
        if i >= 3:
            spent.append(time.perf_counter() - t)
    return {"bytes": numel * 4, "all_gather_s": statistics.median(spent)}


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    result: dict[str, Any] = {"phases": _phases(args, rank), "gathers": _gathers(args, rank)}
    dist.barrier()
    if rank == 0:
        Path(out, "rank0.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--modes", nargs="+", choices=("ddp", "zero1", "zero2", "zero3"), default=["ddp", "zero1"])
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per mode")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--gather-repeats", type=int, default=12, help="timed all-gathers")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = default_batch(args.model)
    if args.quick:
        args.blocks, args.block, args.gather_repeats = 1, 2, 2
    world = 2
    with tempfile.TemporaryDirectory(prefix="bench-zero-phases-") as tmp:
        start = mp.start_processes  # type: ignore[attr-defined]
        start(worker, args=(world, f"{tmp}/store", args, tmp), nprocs=world, start_method="spawn")
        result = json.loads(Path(tmp, "rank0.json").read_text())
    print(f"world size 2 over gloo, {args.model}, fp32 AdamW, one thread a rank; medians of {args.blocks} blocks "
          f"of {args.block} steps per mode, interleaved (rank 0), ms:\n")  # fmt: skip
    rows = [[m, *(f"{result['phases'][m][p] * 1e3:.1f}" for p in PHASE_NAMES)] for m in args.modes]
    print_table(["mode", *PHASE_NAMES], rows)
    g = result["gathers"]
    gathered = f"{g['bytes'] / 2**20:.1f} MiB gathered from two ranks"
    print(f"\n{gathered} by the sharded engines' gather (comm/ops.py): {g['all_gather_s'] * 1e3:.2f} ms")
    write_json(f"zero_phases_{args.model}", {"settings": vars(args), **result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
