"""How many bytes of model state does each rank hold under ddp, zero1 and zero2, against the ZeRO formula?

    python benchmarks/bench_zero_memory.py                 # N = 1..4 ranks over gloo, the 10M MLP and a 53.6M one
    python benchmarks/bench_zero_memory.py --quick         # the 10M MLP at N = 1, 2 only: a smoke run

In every rank, for each strategy in turn (the same processes, the same model and data): fp32 AdamW, one training
step, then every tensor alive in the process is found (``gc``), tensors sharing storage counted once, and their
storage bytes summed, less what the process held before the model was built. That is the model state the rank
actually holds at the end of a step: the weights, the gradients (whole under ddp and zero1, where the buckets are
the gradients; this rank's parts under zero2), and AdamW's two moments (whole, or this rank's shard). No bucket is
in flight then: zero2 gives each bucket's buffer back once its reduce-scatter is done.

The formula (Rajbhandari et al. 2020, fp32 AdamW, Ψ parameters, N ranks): ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2
4Ψ + 12Ψ/N. The target: every measured figure within 5% of it (the padding of each bucket to N equal parts and
the batch are what separate them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import print_table, write_json
from torch import nn

import paratrain

STRATEGIES = ("ddp", "zero1", "zero2")
TOLERANCE = 0.05
BYTES_PER_PARAM = {  # (whole, divided by N): fp32 weights 4, gradients 4, AdamW's two moments 8
    "ddp": (16, 0),
    "zero1": (8, 8),
    "zero2": (4, 12),
}
MODELS = {  # name: (input width, hidden width, hidden layers)
    "mlp 10M": (784, 2048, 3),
    "mlp 53.6M": (784, 4096, 4),
}


def mlp(inputs: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def held_bytes() -> int:
    """Storage bytes of every tensor alive in this process that Python can reach, each storage counted once."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some lazy module objects warn about
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(strategy: str, spec: tuple[int, int, int], batch: int) -> dict[str, Any]:
    before = held_bytes()
    with paratrain.Parallel(strategy, "cpu") as par:
        net = mlp(*spec)
        params = sum(p.numel() for p in net.parameters())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(batch, spec[0], generator=g), torch.randint(0, 10, (batch,), generator=g))]
        net, opt, loader = par.prepare(net, opt, data)
        for x, y in loader:
            par.backward(nn.functional.cross_entropy(net(x), y))
            par.step(opt)
        del x, y, loader, data
        held = held_bytes() - before
        del net, opt
    gc.collect()
    return {"params": params, "bytes": held}


def worker(rank: int, world: int, store: str, models: list[str], out: str) -> None:
    torch.set_num_threads(1)
    init = f"file://{store}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    found = {name: {s: measure(s, MODELS[name], 4 * world) for s in STRATEGIES} for name in models}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    os._exit(0)  # the group's teardown is not what is measured


def run(world: int, models: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-zero-memory-") as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", models, tmp), nprocs=world, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-world-size", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the 10M MLP at N = 1, 2: a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    models = ["mlp 10M"] if args.quick else list(MODELS)
    sizes = range(1, (2 if args.quick else args.max_world_size) + 1)
    rows, results = [], []
    for n in sizes:
        ranks = run(n, models)
        for name in models:
            for strategy in STRATEGIES:
                measured = [rank[name][strategy]["bytes"] for rank in ranks]
                psi = ranks[0][name][strategy]["params"]
                whole, divided = BYTES_PER_PARAM[strategy]
                formula = whole * psi + divided * psi / n
                worst = max(measured, key=lambda b: abs(b / formula - 1))
                error = worst / formula - 1
                results.append(
                    {
                        "model": name,
                        "params": psi,
                        "world_size": n,
                        "strategy": strategy,
                        "measured_bytes_per_rank": measured,
                        "formula_bytes": formula,
                        "error": error,
                        "within": abs(error) <= TOLERANCE,
                    }
                )
                rows.append(
                    [
                        name,
                        n,
                        strategy,
                        f"{max(measured) / 2**20:.1f}",
                        f"{formula / 2**20:.1f}",
                        f"{whole}+{divided}/N" if divided else f"{whole}",
                        f"{error:+.2%}",
                        "yes" if abs(error) <= TOLERANCE else "NO",
                    ]
                )
    headers = ["model", "N", "strategy", "measured MiB/rank", "formula MiB", "bytes/param", "error", "within 5%"]
    print_table(headers, rows)
    print("\nmeasured: every tensor alive in the rank after one fp32 AdamW step, storages counted once (the worst")
    print("rank's); formula: ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N")
    ok = all(r["within"] for r in results)
    write_json("bench_zero_memory", {"tolerance": TOLERANCE, "ok": ok, "results": results}, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
