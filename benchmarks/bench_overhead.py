"""What does paratrain's engine cost? The tutorial's job through paratrain against hand-written loops.

    OMP_NUM_THREADS=1 python benchmarks/bench_overhead.py                  # 3 interleaved rounds, 1 epoch each
    OMP_NUM_THREADS=1 python benchmarks/bench_overhead.py --rounds 5 --out /tmp/overhead.json
    python benchmarks/bench_overhead.py --quick                            # 4 batches: a smoke run, no figure

One epoch of the tutorial's job (SimpleNet, digits60k's 60,000 MNIST-format images, global batch 64,
SGD(lr=0.01)), one thread per process, each configuration in a fresh process, round robin, medians:

- ``hand``: a plain torch loop on tensor batches (the whole set as a tensor, one ``index_select`` per batch on a
  seeded permutation), no paratrain: the baseline of ``single``;
- ``train``: ``paratrain train --strategy single`` (its ``samples_per_second``: the training steps only);
- ``prepare``: the same loop written as a user would, a ``DataLoader(TensorDataset, 64, shuffle=True)`` through
  ``Parallel("single").prepare`` (the DataLoader fast path);
- ``dataloader``: that DataLoader loop without paratrain (per-sample indexing and collation);
- ``dp1``: ``paratrain train --strategy dp --devices cpu`` (DataParallel at one replica: its overhead);
- ``torch-ddp``: torch's DistributedDataParallel under torchrun, 2 processes over gloo, each indexing its share of
  every global batch of 64: the baseline of ``ddp:2``;
- ``train-ddp``: ``paratrain train --strategy ddp --nproc-per-node 2``.

Targets: train/hand, prepare/hand and prepare/train at least 0.97; train-ddp/torch-ddp at least 0.97. The script
prints the ratios against them and never fails on them (a shared machine's load moves them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SINGLE = ("hand", "train", "prepare", "dataloader", "dp1")
TWO = ("torch-ddp", "train-ddp")
RATIOS = (  # (name, numerator, denominator, target or None)
    ("train / hand", "train", "hand", 0.97),
    ("prepare / hand", "prepare", "hand", 0.97),
    ("prepare / train", "prepare", "train", 0.97),
    ("dataloader / hand", "dataloader", "hand", None),
    ("dp1 / train", "dp1", "train", None),
    ("train-ddp / torch-ddp", "train-ddp", "torch-ddp", 0.97),
)
BATCH, LR, SEED = 64, 0.01, 0


# -- one configuration, in its own process ---------------------------------------------------------------------------


def _data(quick: bool) -> tuple[Any, Any]:
    from paratrain.training.datasets import load_dataset

    train = load_dataset("digits60k").train
    if quick:
        return train.inputs[: 4 * BATCH], train.targets[: 4 * BATCH]
    return train.inputs, train.targets


def _model_and_optimizer() -> tuple[Any, Any]:
    import torch

    from paratrain.training.models import SimpleNet

    torch.manual_seed(SEED)
    model = SimpleNet()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def _hand(quick: bool) -> float:
    import torch
    import torch.nn.functional as F

    x_all, y_all = _data(quick)
    model, optimizer = _model_and_optimizer()
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(SEED))
    started = time.perf_counter()
    for start in range(0, len(y_all), BATCH):
        index = order[start : start + BATCH]
        x, y = x_all.index_select(0, index), y_all.index_select(0, index)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return len(y_all) / (time.perf_counter() - started)


def _loader(quick: bool) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x_all, y_all = _data(quick)
    return DataLoader(
        TensorDataset(x_all, y_all), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )


def _prepare(quick: bool) -> float:
    import torch.nn.functional as F

    import paratrain

    model, optimizer = _model_and_optimizer()
    plain = _loader(quick)
    with paratrain.Parallel("single", "cpu") as par:
        model, optimizer, loader = par.prepare(model, optimizer, plain)
        started = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            par.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        return len(plain.dataset) / (time.perf_counter() - started)


def _dataloader(quick: bool) -> float:
    import torch.nn.functional as F

    model, optimizer = _model_and_optimizer()
    loader = _loader(quick)
    started = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return len(loader.dataset) / (time.perf_counter() - started)


def _train(quick: bool, strategy: str) -> float:
    from paratrain.training import TrainConfig, train

    result = train(
        TrainConfig(
            dataset="digits60k",
            epochs=1,
            strategy=strategy,
            devices="cpu",
            quiet=True,
            max_steps=4 if quick else None,
            log_every=10**9,
        )
    )
    return result.samples_per_second


def _torch_ddp(quick: bool, out: Path) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.dp.scatter_gather import shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_all, y_all = _data(quick)
    model, _ = _model_and_optimizer()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(SEED))
    dist.barrier()
    started = time.perf_counter()
    for start in range(0, len(y_all), BATCH):
        batch = order[start : start + BATCH]
        mine = shard(batch, rank, world)
        x, y = x_all.index_select(0, mine), y_all.index_select(0, mine)
        optimizer.zero_grad()
        # the share's mean, weighted by its part of the global batch: the global mean's gradient, as paratrain's
        (F.cross_entropy(ddp(x), y) * (len(mine) * world / len(batch))).backward()
        optimizer.step()
    dist.barrier()
    rate = len(y_all) / (time.perf_counter() - started)
    if rank == 0:
        out.write_text(json.dumps(rate))
    dist.destroy_process_group()
    return rate


def worker(mode: str, quick: bool, out: Path) -> None:
    if mode == "torch-ddp":
        _torch_ddp(quick, out)
        return
    rates = {
        "hand": lambda: _hand(quick),
        "train": lambda: _train(quick, "single"),
        "dp1": lambda: _train(quick, "dp"),
        "prepare": lambda: _prepare(quick),
        "dataloader": lambda: _dataloader(quick),
    }
    out.write_text(json.dumps(rates[mode]()))


# -- the driver: every configuration in a fresh process, round robin ---------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}


def run(mode: str, quick: bool, workdir: Path) -> float:
    out = workdir / f"{mode}.json"
    out.unlink(missing_ok=True)
    me = [str(HERE / "bench_overhead.py"), "--worker", mode, "--worker-out", str(out)] + (["--quick"] if quick else [])
    if mode == "torch-ddp":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *me]
    elif mode == "train-ddp":
        metrics = workdir / "train-ddp-metrics.json"
        command = [sys.executable, "-m", "paratrain", "train", "--strategy", "ddp", "--nproc-per-node", "2"]
        command += ["--dataset", "digits60k", "--epochs", "1", "--quiet", "--log-every", str(10**9)]
        command += ["--metrics-out", str(metrics)] + (["--max-steps", "4"] if quick else [])
        subprocess.run(command, check=True, env=_env(), stdout=subprocess.DEVNULL)
        return float(json.loads(metrics.read_text())["samples_per_second"])
    else:
        command = [sys.executable, *me]
    done = subprocess.run(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:  # say why, instead of a CalledProcessError with the worker's words thrown away
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"bench_overhead: the {mode} worker exited with code {done.returncode}:\n{tail}")
    return float(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 batches per configuration: a smoke run")
    parser.add_argument("--only", nargs="+", choices=[*SINGLE, *TWO], help="these configurations only")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/bench_overhead.json)")
    parser.add_argument("--worker", choices=[*SINGLE, *TWO], help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        worker(args.worker, args.quick, Path(args.worker_out))
        return
    from bench_common import print_table, write_json

    modes = list(args.only or (*SINGLE, *TWO))
    samples: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # the order rotates each round
                samples[mode].append(run(mode, args.quick, Path(tmp)))
    medians = {m: statistics.median(v) for m, v in samples.items()}
    print_table(
        ["configuration", "samples/s (median)", "rounds"],
        [[m, medians[m], ", ".join(f"{v:,.0f}" for v in samples[m])] for m in modes],
    )
    rows, ratios = [], {}
    for name, top, bottom, target in RATIOS:
        if top in medians and bottom in medians:
            ratio = medians[top] / medians[bottom]
            ratios[name] = {"ratio": ratio, "target": target, "met": None if target is None else ratio >= target}
            rows.append(
                [name, ratio, "-" if target is None else f">= {target}", "" if target is None else ratio >= target]
            )
    print()
    print_table(["ratio", "value", "target", "met"], rows)
    if args.quick:
        print("\n--quick: a smoke run of 4 batches, not a measurement")
    write_json("bench_overhead", {"rounds": args.rounds, "quick": args.quick, "samples": samples, "medians": medians,
                                  "ratios": ratios}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
