"""What a training run reports: the result record, the model fingerprint, the metrics file.

fingerprint(model.state_dict())      # sha256 over the tensors in key order: equal runs, equal hashes
write_metrics(result, "metrics.json")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ConfigError
from paratrain.files import atomic_writer

__all__ = ["TrainResult", "fingerprint", "write_metrics"]


def fingerprint(state: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """sha256 of a state_dict's tensors in key order (names, dtypes and shapes included); the state may come as
    its items, one at a time (a zero3 model's, gathered unit by unit)."""
    digest = hashlib.sha256()
    for key, value in state.items() if isinstance(state, Mapping) else state:
        if not isinstance(value, torch.Tensor):
            continue
        t = value.detach().to("cpu").contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@dataclass
class TrainResult:
    """The outcome of ``paratrain train``; ``write_metrics`` stores it as JSON."""

    test_accuracy: float
    train_loss: float
    epochs: int
    samples_per_second: float  # training steps only: evaluation and checkpoint writes are timed apart
    wall_seconds: float
    strategy: str
    devices: list[str]
    seed: int
    model_fingerprint: str
    model: str = ""
    dataset: str = ""
    batch_size: int = 0
    lr: float = 0.0
    world_size: int = 1
    steps: int = 0
    samples: int = 0
    resumed_from: str | None = None
    epoch_losses: list[float] = field(default_factory=list)  # each epoch's mean train loss since the run began
    restarts: int = 0  # how often the launcher restarted the workers (each resumed from the latest checkpoint)
    steps_redone: int = 0  # steps trained again because a failure lost them (summed over restarts)
    recovery_seconds: float = 0.0  # from the last step before each failure to the first one after resuming
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # each restart's figures
    epoch_test_accuracy: list[float] = field(default_factory=list)  # after each epoch since the run began
    precision: str = "32"
    accumulate: int = 1
    optimizer: str = "sgd"
    optimizer_settings: dict[str, Any] = field(default_factory=dict)  # as the optimizer holds them
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip_grad_norm: float | None = None
    skipped_steps: int = 0  # optimizer steps 16-mixed skipped (inf/nan gradients), over the whole run
    train_seconds: float = 0.0  # the training steps of this run (what samples_per_second divides by)
    eval_seconds: float = 0.0  # measuring test accuracy, every time it ran
    checkpoint_seconds: float = 0.0  # writing checkpoints, on the main process
    # each rank's average seconds per step waiting for data, in forward, backward, the optimizer and the rest
    time_breakdown: dict[str, Any] = field(default_factory=dict)
    threads: int = 0  # torch's intra-op CPU threads per process (training/threads.py chose them)
    cores: int = 0  # the machine's
    load_average: float | None = None  # the machine's over one minute, the higher of the run's start and end
    config: dict[str, Any] = field(default_factory=dict)  # the settings it ran with (TrainConfig.to_dict())
    environment: dict[str, Any] = field(default_factory=dict)  # versions, devices, world size, backend
    start_step: int = 0  # optimizer steps the run had done when this invocation began (0, or where it resumed)
    step_flops: float | None = None  # FLOPs of one optimizer step over every process (counted once); None: uncounted
    # each process's peak memory in MiB, in rank order: the CPU's peak resident set (VmHWM) or the most torch had
    # allocated on the GPU, over the whole process (start-up, data, training, evaluation); None where unreadable
    peak_memory_mib: list[float | None] = field(default_factory=list)
    logged_steps: list[dict[str, Any]] = field(default_factory=list)  # the log line's values at each logged step

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        skipped = f"  {self.skipped_steps} steps skipped (inf/nan gradients)" if self.skipped_steps else ""
        busy = ""
        if self.load_average is not None and self.cores and self.load_average > self.cores:
            busy = (
                f"  (the machine was oversubscribed, load average {self.load_average:.1f} on {self.cores} cores: "
                f"timings are slower than on a quiet machine)"
            )
        each = " per process" if self.world_size > 1 else ""
        threads = f", {self.threads} CPU thread{'s' * (self.threads != 1)}{each}" if self.threads else ""
        return (
            f"test accuracy {self.test_accuracy:.2%}  train loss {self.train_loss:.4f}  "
            f"wall {self.wall_seconds:.1f}s  {self.samples_per_second:,.0f} samples/s  "
            f"strategy {self.strategy} on {', '.join(self.devices)}{threads}{skipped}{busy}"
        )


def write_metrics(result: TrainResult, path: str | Path) -> Path:
    """Write the result as JSON, atomically, never over a device or a link (see :mod:`paratrain.files`)."""
    try:
        with atomic_writer(path, "w") as f:
            json.dump(result.as_dict(), f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise ConfigError(f"cannot write metrics to {path}: {exc.strerror or exc}; pick a writable path") from exc
    return Path(path)
