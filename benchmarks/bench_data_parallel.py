"""How much does paratrain's DataParallel cost or buy per training step, and what does replica reuse save?

    python benchmarks/bench_data_parallel.py                 # CPU replicas: 1, 2, 4 against the plain step
    python benchmarks/bench_data_parallel.py --quick         # fewer repeats, for a smoke run
    python benchmarks/bench_data_parallel.py --gpu           # also repeated cuda:0 replicas vs torch's DataParallel

A step is forward, backward and an SGD step on the same global batch. The baseline is the plain model on one
device, timed in the same run. Replica creation is timed with reuse (paratrain's default: the replica objects
are built once, only tensors are refreshed) and without (fresh replicas every call, as torch.nn.DataParallel
does), on models with few and with many modules.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from bench_common import median, print_table, sgd_step, time_call, write_json
from torch import nn

from paratrain import DataParallel
from paratrain.dp.replicate import Replicator
from paratrain.training.models import SimpleNet


def wide_mlp() -> nn.Module:
    # 784 -> 2048 -> 2048 -> 2048 -> 10: about 10M parameters
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


def deep_mlp() -> nn.Module:
    # many small modules: where rebuilding replicas every call costs the most
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, 64)]
    for _ in range(48):
        layers += [nn.ReLU(), nn.Linear(64, 64)]
    layers += [nn.ReLU(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {"simplenet": SimpleNet, "mlp-10m": wide_mlp, "deep-mlp": deep_mlp}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def bench_steps(
    name: str, batch: int, replicas: list[int], repeats: int, device: str, rows: list, results: list
) -> None:
    """Plain and DataParallel steps, interleaved one step each in turn so drift hits them alike."""
    torch.manual_seed(0)
    base = MODELS[name]().to(device)
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    wrapped = {n: DataParallel(copy.deepcopy(base), device_ids=[device] * n) for n in replicas}
    steps = {"plain": sgd_step(copy.deepcopy(base), x, y)}
    steps.update({f"dp x{n} {device}": sgd_step(dp, x, y) for n, dp in wrapped.items()})
    samples = interleaved(steps, repeats, device)
    plain = median(samples["plain"])
    for label, times in samples.items():
        t = median(times)
        rows.append([name, f"{n_params(base) / 1e6:.2f}M", batch, label, t * 1e3, t / plain])
        results.append({"model": name, "batch": batch, "mode": label, "step_ms": t * 1e3, "ratio": t / plain})
    for dp in wrapped.values():
        dp.close()


def interleaved(steps: dict[str, Callable[[], None]], repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per call of each step, one call of each in turn (order alternating), after a warm-up."""
    order = list(steps.items())
    samples: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(3):
        for _, fn in order:
            fn()
    for i in range(repeats):
        for label, fn in order if i % 2 == 0 else order[::-1]:
            samples[label].extend(time_call(fn, repeats=1, warmup=0, device=device))
    return samples


def bench_replicate(name: str, n: int, repeats: int, device: str, rows: list, results: list) -> None:
    model = MODELS[name]().to(device)
    devices = [torch.device(device)] * n
    reuse = Replicator(model, devices)

    def reused() -> None:
        reuse.replicate().release()

    def fresh() -> None:
        Replicator(model, devices).replicate().release()

    t_reuse = median(time_call(reused, repeats=repeats, device=device))
    t_fresh = median(time_call(fresh, repeats=repeats, device=device))
    modules = len(list(model.modules()))
    rows.append([name, modules, n, t_fresh * 1e3, t_reuse * 1e3, t_fresh / t_reuse])
    results.append(
        {
            "model": name,
            "modules": modules,
            "replicas": n,
            "fresh_ms": t_fresh * 1e3,
            "reuse_ms": t_reuse * 1e3,
            "speedup": t_fresh / t_reuse,
        }
    )


def bench_gpu(repeats: int, rows: list, results: list) -> None:
    """Repeated cuda:0 replicas (each on its own stream) against torch's DataParallel and the plain step."""
    for name in ("simplenet", "mlp-10m"):
        torch.manual_seed(0)
        base = MODELS[name]().cuda()
        for batch in (64, 1024):
            x = torch.randn(batch, 784, device="cuda")
            y = torch.randint(0, 10, (batch,), device="cuda")
            plain = median(time_call(sgd_step(copy.deepcopy(base), x, y), repeats=repeats, device="cuda"))
            entries: list[tuple[str, float]] = [("plain cuda:0", plain)]
            for n in (2, 4):
                dp = DataParallel(copy.deepcopy(base), device_ids=["cuda:0"] * n)
                entries.append((f"paratrain dp cuda:0 x{n}", median(time_call(sgd_step(dp, x, y), repeats=repeats))))
                dp.close()
            try:
                tdp = nn.DataParallel(copy.deepcopy(base), device_ids=[0, 0])
                entries.append(("torch dp [0, 0]", median(time_call(sgd_step(tdp, x, y), repeats=repeats))))
            except Exception as exc:  # torch may refuse repeated devices
                entries.append((f"torch dp [0, 0] refused: {type(exc).__name__}", float("nan")))
            tdp1 = nn.DataParallel(copy.deepcopy(base), device_ids=[0])
            entries.append(("torch dp [0]", median(time_call(sgd_step(tdp1, x, y), repeats=repeats))))
            for label, t in entries:
                rows.append([name, batch, label, t * 1e3, t / plain])
                results.append({"model": name, "batch": batch, "mode": label, "step_ms": t * 1e3, "ratio": t / plain})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run, not a measurement")
    parser.add_argument("--gpu", action="store_true", help="also run the CUDA comparison (needs a GPU)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/data_parallel.json)")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    payload: dict[str, Any] = {"repeats": repeats, "quick": args.quick}

    print(f"Training step on CPU (median of {repeats}; ratio = step time / plain step time, lower is better)\n")
    rows: list = []
    steps: list = []
    for name, batch in (("simplenet", 256), ("mlp-10m", 256)):
        bench_steps(name, batch, [1, 2, 4], repeats, "cpu", rows, steps)
    print_table(["model", "params", "batch", "mode", "step ms", "ratio"], rows)
    payload["cpu_steps"] = steps

    print(f"\nReplica creation, {repeats} repeats: fresh every call (torch's way) vs reused (paratrain's)\n")
    rows, reps = [], []
    for name in MODELS:
        for n in (2, 4):
            bench_replicate(name, n, repeats * 4, "cpu", rows, reps)
    print_table(["model", "modules", "replicas", "fresh ms", "reuse ms", "fresh/reuse"], rows)
    payload["replicate"] = reps

    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu asked for, but no GPU is visible", file=sys.stderr)
            return 2
        print(f"\nTraining step on {torch.cuda.get_device_name(0)} (median of {repeats})\n")
        rows, gpu = [], []
        bench_gpu(repeats, rows, gpu)
        print_table(["model", "batch", "mode", "step ms", "ratio"], rows)
        payload["gpu_steps"] = gpu
        rows, reps = [], []
        for name in MODELS:
            bench_replicate(name, 4, repeats * 4, "cuda", rows, reps)
        print_table(["model", "modules", "replicas", "fresh ms", "reuse ms", "fresh/reuse"], rows)
        payload["gpu_replicate"] = reps

    write_json("data_parallel", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
