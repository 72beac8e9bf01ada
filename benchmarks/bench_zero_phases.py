"""Where zero1's and zero2's step goes, phase by phase, beside ddp's; and what the in-flight machinery costs.

    .venv/bin/python benchmarks/bench_zero_phases.py --model gpt      # the small GPT (bench_zero_modes.py's)
    .venv/bin/python benchmarks/bench_zero_phases.py                  # the 10M MLP
    .venv/bin/python benchmarks/bench_zero_phases.py --quick          # a smoke run

In two gloo processes, the modes take turns block by block (5 steps a block, the first block of each mode
untimed); each step is timed in four phases: zero_grad, forward (with the loss), backward, optimizer step. The
forward's "waiting" column is the time its all-gathers of updated weights were waited for (zero1 and zero2 leave
them in flight when the step returns: ``paratrain.sharded.in_flight``). Medians over the timed steps, rank 0.

Two measurements beside it, in rank 0 alone:
- a dispatch mode's cost: the model's forward plain and under an empty ``TorchDispatchMode`` (what the in-flight
  mode costs every operation it sees), with the number of operations a forward dispatches;
- all-gathering a buffer of the model's size: gloo's all-gather against an exchange of halves by send and receive
  (both ranks), the design that was not kept because gloo's send/receive Works report completion only once waited.
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
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.sharded.reducer import all_gather_into

PHASE_NAMES = ("zero_grad", "forward", "waiting", "backward", "step", "total")


class _Empty(TorchDispatchMode):
    """Passes every operation through, counting them: the cost of a mode alone."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


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


def _mode_cost(args: argparse.Namespace) -> dict[str, float]:
    net = build_model(args.model, args.width, args.depth)
    x, y = make_batch(args.model, args.batch, 0)
    plain, moded, ops = [], [], 0
    for _ in range(args.mode_repeats):
        t0 = time.perf_counter()
        loss_of(net(x), y)
        t1 = time.perf_counter()
        with _Empty() as empty:
            loss_of(net(x), y)
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        moded.append(t2 - t1)
        ops = empty.ops
    p, m = statistics.median(plain), statistics.median(moded)
    return {"plain_s": p, "mode_s": m, "ops": ops, "per_op_s": (m - p) / max(ops, 1)}


def _gathers(args: argparse.Namespace, rank: int) -> dict[str, float]:
    numel = sum(p.numel() for p in build_model(args.model, args.width, args.depth).parameters()) // 2 * 2
    buffer, part = torch.zeros(numel), numel // 2
    own = buffer.narrow(0, rank * part, part)
    peer = 1 - rank

    def gather() -> None:
        all_gather_into(buffer, own, None).wait()

    def exchange(tag: int) -> None:
        works = []
        for r in range(2):
            view = buffer.narrow(0, r * part, part)
            works.append(dist.isend(view, peer, tag=tag + r) if r == rank else dist.irecv(view, peer, tag=tag + r))
        for work in works:
            work.wait()

    spent: dict[str, list[float]] = {"all_gather_s": [], "exchange_s": []}
    for i in range(args.gather_repeats + 3):
        for name in spent:
            dist.barrier()
            t = time.perf_counter()
            gather() if name == "all_gather_s" else exchange(100 + 2 * i)
            if i >= 3:
                spent[name].append(time.perf_counter() - t)
    return {"bytes": numel * 4, **{k: statistics.median(v) for k, v in spent.items()}}


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))  # fmt: skip
    result: dict[str, Any] = {"phases": _phases(args, rank), "gathers": _gathers(args, rank)}
    dist.barrier()
    if rank == 0:
        result["mode_cost"] = _mode_cost(args)
        Path(out, "rank0.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--modes", nargs="+", choices=("ddp", "zero1", "zero2", "zero3"), default=["ddp", "zero1"])
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per mode")
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--mode-repeats", type=int, default=12, help="forwards timed with and without a mode")
    parser.add_argument("--gather-repeats", type=int, default=12, help="timed all-gathers and exchanges")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = default_batch(args.model)
    if args.quick:
        args.blocks, args.block, args.mode_repeats, args.gather_repeats = 1, 2, 2, 2
    world = 2
    with tempfile.TemporaryDirectory(prefix="bench-zero-phases-") as tmp:
        start = mp.start_processes  # type: ignore[attr-defined]
        start(worker, args=(world, f"{tmp}/store", args, tmp), nprocs=world, start_method="spawn")
        result = json.loads(Path(tmp, "rank0.json").read_text())
    print(f"world size 2 over gloo, {args.model}, fp32 AdamW, one thread a rank; medians of {args.blocks} blocks "
          f"of {args.block} steps per mode, interleaved (rank 0), ms:\n")  # fmt: skip
    rows = [[m, *(f"{result['phases'][m][p] * 1e3:.1f}" for p in PHASE_NAMES)] for m in args.modes]
    print_table(["mode", *PHASE_NAMES], rows)
    cost = result["mode_cost"]
    print(
        f"\na forward plain {cost['plain_s'] * 1e3:.1f} ms, under an empty dispatch mode {cost['mode_s'] * 1e3:.1f} "
        f"ms: {cost['ops']} operations, {cost['per_op_s'] * 1e6:.0f} us an operation"
    )
    g = result["gathers"]
    print(
        f"{g['bytes'] / 2**20:.1f} MiB gathered from two ranks: gloo's all-gather {g['all_gather_s'] * 1e3:.2f} ms, "
        f"an exchange of halves by send and receive {g['exchange_s'] * 1e3:.2f} ms"
    )
    write_json(f"zero_phases_{args.model}", {"settings": vars(args), **result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
