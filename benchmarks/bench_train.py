"""Is ``paratrain train`` faster than the tutorial's loop as users write it, at the same accuracy?

    python benchmarks/bench_train.py                        # 5 epochs of digits60k (the tutorial's), median of 3
    python benchmarks/bench_train.py --epochs 1             # a shorter run (accuracy then differs by shuffle noise)
    python benchmarks/bench_train.py --quick                # 4,096 samples, 1 repeat: a smoke run, not a measurement
    python benchmarks/bench_train.py --device cpu --num-workers 2 --out /tmp/train.json
    python benchmarks/bench_train.py --threads 1            # steadier figures on a shared machine: 1 thread each
    python benchmarks/bench_train.py --profile 300          # also: where 300 tutorial-loop steps spend their time

Both runs train SimpleNet on ``digits60k`` (60,000 shifted, noisy 28x28 digits) with batch 64, SGD(lr=0.01) and
the same seed, so they start from the same weights; only the shuffle order differs.

- The tutorial loop is the tutorial's code: a Dataset holding uint8 28x28 images, as torchvision's MNIST does,
  that converts each sample in ``__getitem__`` like ``ToTensor()`` + ``Normalize((0.5,), (0.5,))``, a
  ``DataLoader(batch_size=64, shuffle=True)``, ``torch.nn.DataParallel(SimpleNet()).to(device)`` and the tutorial's
  loop body. torchvision is not a dependency, so the transforms are written out below in torch and numpy; the
  PIL round trip torchvision's MNIST also makes per sample is left out, which makes this baseline a little faster
  than the real one.
- ``paratrain train`` is the library call ``train(TrainConfig(dataset="digits60k", ...))`` in this process.

Throughput is samples per second of the training loop only: dataset construction and evaluation are outside the
timer. ``TrainResult.samples_per_second`` times paratrain's loop; the whole ``train()`` call (strategy set-up,
model, evaluation) is timed too and reported beside it. Runs alternate tutorial, paratrain, tutorial, ... so drift on a
shared machine hits both alike. The script reports against the targets (1.5x on a CPU, 20x on a GPU, accuracy
within one point); it never fails on them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_common import print_table, sync, write_json
from torch import nn
from torch.utils.data import DataLoader, Dataset

from paratrain.training import TrainConfig, train
from paratrain.training.data import TensorData
from paratrain.training.datasets import load_dataset
from paratrain.training.models import SimpleNet

DATASET = "digits60k"
BATCH_SIZE = 64  # the tutorial's
LR = 0.01  # the tutorial's
QUICK_SAMPLES = 4096
WARMUP_STEPS = 10
# the targets: paratrain / tutorial throughput, by device type, at test accuracy within one point
TARGET_SPEEDUP = {"cpu": 1.5, "cuda": 20.0}
ACCURACY_TOLERANCE = 0.01
MEAN, STD = (0.5,), (0.5,)


# --- the tutorial's data pipeline, one sample at a time --------------------------------------------------------------


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """What ``transforms.ToTensor()`` does to an HxW uint8 image: a (1, H, W) float tensor in [0, 1]."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True))  # (H, W)
    pixels = pixels.view(image.shape[0], image.shape[1], 1).permute(2, 0, 1).contiguous()  # HWC -> CHW
    return pixels.to(dtype=torch.get_default_dtype()).div(255)


def normalize(tensor: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """What ``transforms.Normalize(mean, std)`` does to one (C, H, W) tensor: ``(x - mean) / std`` per channel."""
    tensor = tensor.clone()  # Normalize(inplace=False) copies first
    mean_t = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device)
    std_t = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device)
    if (std_t == 0).any():
        raise ValueError(f"std evaluated to zero after conversion to {tensor.dtype}, leading to division by zero.")
    return tensor.sub_(mean_t.view(-1, 1, 1)).div_(std_t.view(-1, 1, 1))


class SeedDigits(Dataset[tuple[torch.Tensor, int]]):
    """Images held as raw uint8 (N, 28, 28), converted per sample in ``__getitem__``, like torchvision's MNIST."""

    def __init__(self, images: np.ndarray, targets: np.ndarray) -> None:
        self.data = images  # (N, 28, 28) uint8
        self.targets = targets  # (N,) int64

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, target = self.data[index], int(self.targets[index])
        return normalize(to_tensor(image), MEAN, STD), target


def to_uint8(split: TensorData) -> SeedDigits:
    """The normalised float images back as the uint8 0..255 images a user's dataset would hold."""
    pixels = ((split.inputs * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)  # (N, 1, 28, 28)
    return SeedDigits(pixels.squeeze(1).numpy().copy(), split.targets.numpy().copy())


# --- the two runs -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One timed training run."""

    samples: int
    steps: int
    loop_seconds: float
    test_accuracy: float
    call_seconds: float | None = None  # paratrain: the whole train() call
    data_seconds: float | None = None  # tutorial loop: time spent waiting on the DataLoader

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.loop_seconds

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_second": self.samples_per_second}


def seed_model(device: torch.device) -> nn.Module:
    # the tutorial's nn.DataParallel(SimpleNet()).to(device): every visible GPU, or the module as is without one. With
    # GPUs visible it insists on the module living on cuda:0, so a CPU run on a GPU machine uses the plain module.
    if device.type == "cpu" and torch.cuda.is_available():
        return SimpleNet()
    return nn.DataParallel(SimpleNet()).to(device)


def run_seed_loop(
    train_set: SeedDigits,
    test: TensorData,
    *,
    epochs: int,
    seed: int,
    device: torch.device,
    num_workers: int,
    max_steps: int | None,
    log: bool,
) -> Run:
    """The tutorial's loop, timed from the first batch request to the last optimizer step."""
    torch.manual_seed(seed)  # the same initial weights as paratrain's run, and the DataLoader's shuffle
    model = seed_model(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers)

    samples = steps = 0
    data_seconds = 0.0
    sync(device)
    start = time.perf_counter()
    for epoch in range(epochs):
        fetch_start = time.perf_counter()
        for i, (images, labels) in enumerate(train_loader):
            data_seconds += time.perf_counter() - fetch_start
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            if log and i % 100 == 0:
                print(f"Epoch {epoch}, Step {i}, Loss: {loss.item()}")
            samples += labels.size(0)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
            fetch_start = time.perf_counter()
        if max_steps is not None and steps >= max_steps:
            break
    sync(device)
    loop_seconds = time.perf_counter() - start
    return Run(samples, steps, loop_seconds, seed_accuracy(model, test, device), data_seconds=data_seconds)


def seed_accuracy(model: nn.Module, test: TensorData, device: torch.device) -> float:
    # scored on the very tensors paratrain's evaluate() scores, so the accuracies differ only by the training
    model.eval()
    with torch.no_grad():
        predicted = model(test.inputs.to(device)).argmax(dim=1)
    return float((predicted == test.targets.to(device)).float().mean())


def run_paratrain(*, epochs: int, seed: int, device: torch.device, max_steps: int | None, log: bool) -> Run:
    """``paratrain train`` with the tutorial's model, data, batch and learning rate, in this process."""
    # "auto" on a GPU machine is every visible GPU, as the tutorial's nn.DataParallel uses
    devices = "auto" if device.type == "cuda" else str(device)
    config = TrainConfig(
        model="simplenet",
        dataset=DATASET,
        epochs=epochs,
        batch_size=BATCH_SIZE,
        lr=LR,
        devices=devices,
        seed=seed,
        quiet=not log,
        progress_bar=False,
        max_steps=max_steps,
    )
    sync(device)
    start = time.perf_counter()
    # quiet=True still prints the closing summary line; a no-op log keeps the table readable
    result = train(config, log=None if log else _discard)
    sync(device)
    call_seconds = time.perf_counter() - start
    loop_seconds = result.samples / result.samples_per_second
    return Run(result.samples, result.steps, loop_seconds, result.test_accuracy, call_seconds=call_seconds)


def _discard(line: str) -> None:
    pass


# --- where the tutorial loop's time goes -----------------------------------------------------------------------------


def profile_seed_loop(train_set: SeedDigits, test: TensorData, steps: int, device: torch.device) -> dict[str, Any]:
    """cProfile over ``steps`` steps of the tutorial loop: time by stage, and the functions with most time of their own.

    Run it after the warm-up: the first SGD constructor imports torch._dynamo, seconds that are no loop's cost.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    epochs = -(-steps * BATCH_SIZE // len(train_set))  # enough epochs to reach ``steps``
    run_seed_loop(train_set, test, epochs=epochs, seed=0, device=device, num_workers=0, max_steps=steps, log=False)
    profiler.disable()
    stats: dict = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # set by Stats, absent from typeshed

    def cumulative(file_name: str, function: str) -> float:
        # cProfile counts a recursive function's outermost calls only, so nested collate calls are not doubled
        times = [v[3] for (path, _, name), v in stats.items() if name == function and Path(path).name == file_name]
        return float(sum(times))

    total = cumulative("bench_train.py", "run_seed_loop")
    fetch = cumulative("dataloader.py", "__next__")
    stages = {
        "DataLoader next (per-sample __getitem__ + collate)": fetch,
        "  of which __getitem__ (the ToTensor + Normalize work)": cumulative("bench_train.py", "__getitem__"),
        "  of which default_collate (stacking 64 samples)": cumulative("collate.py", "default_collate"),
        "to(device), forward, loss, backward, SGD step, evaluation": total - fetch,
    }
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in stats.items():
        where = f"{Path(path).name}:{line}" if line else path
        rows.append({"function": f"{name} ({where})", "calls": calls, "own_s": own, "cum_s": cum})
    rows.sort(key=lambda row: row["own_s"], reverse=True)
    return {"steps": steps, "total_s": total, "stages_s": stages, "top_own_time": rows[:12]}


# --- the report ---------------------------------------------------------------------------------------------------


def median_of(runs: Sequence[Run], field: str) -> float:
    values = [value for run in runs if (value := getattr(run, field)) is not None]
    return float(statistics.median(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="epochs of 60,000 samples (default 5, as the seed)")
    parser.add_argument("--repeats", type=int, help="timed runs of each (default 3; 1 with --quick)")
    parser.add_argument("--max-samples", type=int, help="stop each run after this many training samples")
    parser.add_argument("--quick", action="store_true", help=f"--max-samples {QUICK_SAMPLES}, 1 repeat: a smoke run")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    parser.add_argument("--num-workers", type=int, default=0, help="the seed DataLoader's workers (default 0)")
    parser.add_argument("--threads", type=int, help="torch CPU threads for both runs (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", action="store_true", help="print the loss every 100 steps, as the seed does")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS", help="cProfile this many seed steps")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/train.json)")
    args = parser.parse_args(argv)
    if args.epochs < 1 or (args.repeats is not None and args.repeats < 1) or args.num_workers < 0:
        parser.error("--epochs and --repeats must be at least 1, --num-workers at least 0")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        # on a shared machine a matrix multiply split over every core stalls whenever one core is taken away;
        # fewer threads make both runs steadier, and both get the same number
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but no GPU is visible", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    max_samples = args.max_samples or (QUICK_SAMPLES if args.quick else None)
    max_steps = -(-max_samples // BATCH_SIZE) if max_samples else None

    # dataset construction is outside every timer: load_dataset caches digits60k for paratrain's train() calls
    splits = load_dataset(DATASET)
    train_set = to_uint8(splits.train)

    # warm-up: first-call costs (allocator, kernels, CUDA context, thread pools) belong to neither run
    run_seed_loop(
        train_set,
        splits.test,
        epochs=1,
        seed=args.seed,
        device=device,
        num_workers=args.num_workers,
        max_steps=WARMUP_STEPS,
        log=False,
    )
    run_paratrain(epochs=1, seed=args.seed, device=device, max_steps=WARMUP_STEPS, log=False)

    what = f"{max_samples:,} samples" if max_samples else f"{args.epochs} epoch(s) of {len(train_set):,} samples"
    print(
        f"Training SimpleNet on {DATASET}, {what}, batch {BATCH_SIZE}, on {device} "
        f"({torch.get_num_threads()} CPU threads); median of {repeats}\n"
    )
    seed_runs: list[Run] = []
    paratrain_runs: list[Run] = []
    for _ in range(repeats):
        seed_runs.append(
            run_seed_loop(
                train_set,
                splits.test,
                epochs=args.epochs,
                seed=args.seed,
                device=device,
                num_workers=args.num_workers,
                max_steps=max_steps,
                log=args.log,
            )
        )
        paratrain_runs.append(
            run_paratrain(epochs=args.epochs, seed=args.seed, device=device, max_steps=max_steps, log=args.log)
        )

    seed_rate = median_of(seed_runs, "samples_per_second")
    para_rate = median_of(paratrain_runs, "samples_per_second")
    para_call_rate = statistics.median(run.samples / run.call_seconds for run in paratrain_runs if run.call_seconds)
    seed_acc = median_of(seed_runs, "test_accuracy")
    para_acc = median_of(paratrain_runs, "test_accuracy")
    data_share = median_of(seed_runs, "data_seconds") / median_of(seed_runs, "loop_seconds")
    seed_seconds = median_of(seed_runs, "loop_seconds")
    para_seconds = median_of(paratrain_runs, "loop_seconds")
    call_seconds = median_of(paratrain_runs, "call_seconds")
    rows = [
        ["tutorial loop (per-sample DataLoader)", seed_rate, seed_seconds, seed_acc, 1.0],
        ["paratrain train (loop)", para_rate, para_seconds, para_acc, para_rate / seed_rate],
        ["paratrain train() call", para_call_rate, call_seconds, para_acc, para_call_rate / seed_rate],
    ]
    print_table(["run", "samples/s", "seconds", "test acc", "x tutorial"], rows)
    print(f"\nthe tutorial loop waits on its DataLoader for {data_share:.0%} of its loop time")

    speedup = para_rate / seed_rate
    accuracy_gap = para_acc - seed_acc
    target = TARGET_SPEEDUP[device.type]
    fast_enough = speedup >= target
    accurate = abs(accuracy_gap) <= ACCURACY_TOLERANCE
    passed = fast_enough and accurate
    note = " (a smoke run: --quick or --max-samples, not a measurement)" if max_samples else ""
    # the test split is small: each image is a quarter of a point, and shuffle order alone moves a few images
    test_size = len(splits.test)
    print(
        f"target on {device.type}: speed {speedup:.2f}x the tutorial loop, >= {target:g}x "
        f"{'PASS' if fast_enough else 'FAIL'}; test accuracy {accuracy_gap * 100:+.1f} points, within "
        f"{ACCURACY_TOLERANCE * 100:g} {'PASS' if accurate else 'FAIL'} -> {'PASS' if passed else 'FAIL'}{note}"
    )
    print(f"(test accuracy is over {test_size} images: one image is {100 / test_size:.2f} points)")

    payload: dict[str, Any] = {
        "dataset": DATASET,
        "model": "simplenet",
        "batch_size": BATCH_SIZE,
        "lr": LR,
        "epochs": args.epochs,
        "repeats": repeats,
        "max_samples": max_samples,
        "quick": args.quick,
        "device": str(device),
        "num_workers": args.num_workers,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "seed_loop": {
            "samples_per_second": seed_rate,
            "test_accuracy": seed_acc,
            "data_share": data_share,
            "runs": [run.as_dict() for run in seed_runs],
        },
        "paratrain": {
            "samples_per_second": para_rate,
            "call_samples_per_second": para_call_rate,
            "test_accuracy": para_acc,
            "runs": [run.as_dict() for run in paratrain_runs],
        },
        "speedup": speedup,
        "call_speedup": para_call_rate / seed_rate,
        "accuracy_gap": accuracy_gap,
        "test_images": test_size,
        "target": {
            "speedup": target,
            "accuracy_tolerance": ACCURACY_TOLERANCE,
            "fast_enough": fast_enough,
            "accurate": accurate,
            "passed": passed,
        },
    }

    if args.profile:
        print(
            f"\nWhere {args.profile} steps of the tutorial loop spend their time (cProfile, which slows Python code)\n"
        )
        profile = profile_seed_loop(train_set, splits.test, args.profile, device)
        total = profile["total_s"]
        print_table(
            ["stage", "seconds", "share"],
            [[stage, t, f"{t / total:.0%}"] for stage, t in profile["stages_s"].items()],
        )
        print()
        print_table(
            ["function (most time of its own)", "calls", "own s", "cum s"],
            [[r["function"], r["calls"], r["own_s"], r["cum_s"]] for r in profile["top_own_time"]],
        )
        payload["seed_profile"] = profile

    write_json("train", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
