"""The line ``paratrain train`` prints every ``--log-every`` steps, and the same values for the trackers.

    Epoch 0, Step 20, Loss: 2.0523 | grad_norm 1.497 | lr 0.01 | 381 samples/s | step 168 ms | rss 318 MiB | 465 MFLOP/s
    Epoch 0, Step 20, Loss: 0.4123 | ... | memory 812 / 1024 MiB allocated / reserved | 312 TFLOP/s | mfu 31.5%

The tutorial's ``Epoch E, Step S, Loss: L`` comes first, unchanged; then, over the steps since the previous
logged one: the gradient's norm (before clipping) and the learning rate of the logged step, global samples per
second and seconds per step (the step timer's, so evaluation and checkpoints do not count), the memory (on a GPU
allocated and reserved by torch's caching allocator, on the CPU the process's resident set), and the FLOP/s
achieved (one count of a step's FLOPs, :mod:`paratrain.training.flops`, over the time per step) with the model
FLOPs utilisation where the GPU's peak is known. A value that cannot be had is left out, not guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paratrain.parallel import Parallel

__all__ = ["LoggedStep", "StepMeter", "memory", "peak_memory", "peak_memory_of_ranks"]

_MIB = 2**20


def memory(device: torch.device) -> dict[str, float]:
    """Memory in MiB: a GPU's allocated and reserved by torch; on the CPU this process's resident set (Linux)."""
    if device.type == "cuda":
        return {
            "memory/allocated_mib": torch.cuda.memory_allocated(device) / _MIB,
            "memory/reserved_mib": torch.cuda.memory_reserved(device) / _MIB,
        }
    statm = Path("/proc/self/statm")
    try:
        resident_pages = int(statm.read_text().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux: no resident figure, rather than the peak one
        return {}
    return {"memory/rss_mib": resident_pages * os.sysconf("SC_PAGE_SIZE") / _MIB}


def peak_memory(device: torch.device) -> float | None:
    """This process's peak memory in MiB so far: on a GPU the most torch's allocator had allocated on ``device``, on
    the CPU the peak resident set (``VmHWM``, Linux). None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _MIB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / _MIB  # kB
    except (OSError, IndexError, ValueError):
        pass
    return None


def peak_memory_of_ranks(par: Parallel) -> list[float | None]:
    """Every process's :func:`peak_memory`, in rank order, on every rank (a gather: call it in every process)."""
    mine = peak_memory(par.device)
    row = torch.tensor([-1.0 if mine is None else mine], dtype=torch.float64, device=par.device)
    return [None if v < 0 else v for v in par.gather(row).tolist()]


@dataclass(frozen=True)
class LoggedStep:
    """The values of one logged step; :meth:`values` as the trackers name them, :meth:`line` as printed."""

    step: int  # the run's optimizer step, counted from 0
    epoch: int
    batch: int  # within the epoch, as the tutorial's line counts it
    loss: float | None  # the global batch's loss (None when the run is quiet and no one read it)
    grad_norm: float | None
    lr: float
    samples_per_s: float
    step_seconds: float
    memory: dict[str, float]
    flops_per_s: float | None
    mfu: float | None

    def values(self) -> dict[str, float]:
        values = {
            "train/lr": self.lr,
            "train/samples_per_s": self.samples_per_s,
            "train/step_seconds": self.step_seconds,
        }
        if self.grad_norm is not None:
            values["train/grad_norm"] = self.grad_norm
        if self.flops_per_s is not None:
            values["train/flops_per_s"] = self.flops_per_s
        if self.mfu is not None:
            values["train/mfu"] = self.mfu
        return {**values, **self.memory}

    def line(self) -> str:
        parts = [f"Epoch {self.epoch}, Step {self.batch}, Loss: {self.loss}"]
        if self.grad_norm is not None:
            parts.append(f"grad_norm {self.grad_norm:.4g}")
        parts += [f"lr {self.lr:.4g}", f"{self.samples_per_s:.0f} samples/s", f"step {self.step_seconds * 1e3:.3g} ms"]
        if "memory/rss_mib" in self.memory:
            parts.append(f"rss {self.memory['memory/rss_mib']:.0f} MiB")
        if "memory/allocated_mib" in self.memory:
            parts.append(
                f"memory {self.memory['memory/allocated_mib']:.0f} / {self.memory['memory/reserved_mib']:.0f} MiB "
                f"allocated / reserved"
            )
        if self.flops_per_s is not None:
            parts.append(_flops(self.flops_per_s))
        if self.mfu is not None:
            parts.append(f"mfu {self.mfu:.1%}")
        return " | ".join(parts)


def _flops(per_second: float) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if per_second >= scale:
            return f"{per_second / scale:.3g} {prefix}FLOP/s"
    return f"{per_second:.3g} FLOP/s"


class StepMeter:
    """Global samples and step time since the previous logged step; the FLOPs of one step of the whole job.

    Args:
        device: where memory is read.
        step_flops: FLOPs of one optimizer step over every process (None: not counted).
        peak_flops: the peak FLOP/s of all the job's devices together (None: not known, so no MFU).
    """

    def __init__(self, device: torch.device, step_flops: float | None, peak_flops: float | None) -> None:
        self.device = device
        self.step_flops = step_flops
        self.peak_flops = peak_flops
        self._samples = 0
        self._steps = 0
        self._seconds = 0.0  # the step timer's total at the previous logged step

    def add(self, global_samples: int) -> None:
        self._samples += global_samples
        self._steps += 1

    def log(
        self,
        *,
        step: int,
        epoch: int,
        batch: int,
        loss: float | None,
        lr: float,
        grad_norm: float | None,
        seconds: float,
    ) -> LoggedStep:
        """The logged step's values; ``seconds`` is the step timer's total so far. Starts the next interval."""
        elapsed = max(seconds - self._seconds, 1e-9)
        per_step = elapsed / max(self._steps, 1)
        flops_per_s = self.step_flops / per_step if self.step_flops else None
        mfu = flops_per_s / self.peak_flops if flops_per_s is not None and self.peak_flops else None
        logged = LoggedStep(
            step=step,
            epoch=epoch,
            batch=batch,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            samples_per_s=self._samples / elapsed,
            step_seconds=per_step,
            memory=memory(self.device),
            flops_per_s=flops_per_s,
            mfu=mfu,
        )
        self._samples = self._steps = 0
        self._seconds = seconds
        return logged
