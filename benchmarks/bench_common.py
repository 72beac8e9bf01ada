"""Shared pieces of the benchmark scripts: timing with warm-up and device sync, medians, a table, JSON.

Benchmarks compare against a baseline measured in the same invocation and report medians over repeats,
because the machines are shared and noisy; no unit test ever asserts a time.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work so a timer measures the work, not its launch."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_call(
    fn: Callable[[], Any], *, repeats: int, warmup: int = 3, device: torch.device | str | None = None
) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` samples after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return samples


def sgd_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float = 0.01,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy,
) -> Callable[[], None]:
    """One training step on a fixed batch: zero_grad, forward, ``loss`` (cross-entropy), backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()

    return step


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "platform": platform.platform(),
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path
