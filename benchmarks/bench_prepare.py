"""Does ``Parallel.prepare`` cost anything? Its loop against the hand-written one, interleaved in one process.

    OMP_NUM_THREADS=1 python benchmarks/bench_prepare.py                 # 5 rounds over 12,800 samples
    OMP_NUM_THREADS=1 python benchmarks/bench_prepare.py --rounds 9 --samples 60000

``bench_overhead.py`` runs each configuration in a fresh process for one epoch; on a shared VM the fresh
processes' speeds differ by more than the 3% it looks for. Here both loops run in the same process, one after
the other, ``--rounds`` times, so the machine's moods hit both alike: SimpleNet, batch 64, SGD(lr=0.01), one
thread.

- ``hand``: tensor batches by one ``index_select`` each on a random permutation, torch's SGD;
- ``prepare``: ``DataLoader(TensorDataset, 64, shuffle=True)``, model and optimizer through
  ``Parallel("single").prepare``, ``par.backward``: the loop as a user writes it.

Target: prepare / hand at least 0.97 (the medians' ratio).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead
from bench_common import print_table, write_json

import paratrain

TARGET = 0.97


def hand(x_all: torch.Tensor, y_all: torch.Tensor) -> float:
    model, optimizer = bench_overhead._model_and_optimizer()
    order = torch.randperm(len(y_all))
    started = time.perf_counter()
    for start in range(0, len(y_all), bench_overhead.BATCH):
        index = order[start : start + bench_overhead.BATCH]
        x, y = x_all.index_select(0, index), y_all.index_select(0, index)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return len(y_all) / (time.perf_counter() - started)


def prepare(x_all: torch.Tensor, y_all: torch.Tensor) -> float:
    model, optimizer = bench_overhead._model_and_optimizer()
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=bench_overhead.BATCH, shuffle=True)
    with paratrain.Parallel("single", "cpu") as par:
        model, optimizer, loader = par.prepare(model, optimizer, loader)
        started = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            par.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        return len(y_all) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=12_800, help="samples per loop (of digits60k's 60,000)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/bench_prepare.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x_all, y_all = bench_overhead._data(False)
    x_all, y_all = x_all[: args.samples], y_all[: args.samples]
    loops = {"hand": hand, "prepare": prepare}
    for loop in loops.values():  # warm: the first run of each pays one-off costs
        loop(x_all, y_all)
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            rates[name].append(loop(x_all, y_all))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["prepare"] / medians["hand"]
    rows = [[name, medians[name], ", ".join(f"{v:,.0f}" for v in rates[name])] for name in loops]
    print_table(["loop", "samples/s (median)", "rounds"], rows)
    print(f"\nprepare / hand {ratio:.3f} (target >= {TARGET}): {'met' if ratio >= TARGET else 'NOT met'}")
    write_json("bench_prepare", {"rounds": args.rounds, "samples": args.samples, "rates": rates, "ratio": ratio},
               args.out)  # fmt: skip


if __name__ == "__main__":
    main()
