"""Every setting of a training run, defined once: the fields, their defaults, their help and their checks.

``paratrain train``'s flags are generated from :class:`TrainConfig` (``--batch-size`` is ``batch_size``), so a flag
cannot drift from its default or its help. The defaults are the classic MNIST DataParallel tutorial's job:
SimpleNet, batch 64, SGD with learning rate 0.01, 5 epochs.

    config = TrainConfig(epochs=1, strategy="dp", devices="cpu,cpu,cpu")
    config.validate()              # ConfigError naming the flag, before any work starts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..collectives import DEFAULT_TIMEOUT_S
from ..errors import ConfigError
from ..strategies import STRATEGY_NAMES
from .datasets import DATASET_NAMES
from .models import MODEL_NAMES

__all__ = ["RESUME_MODES", "TrainConfig"]

RESUME_MODES = ("latest", "if-exists")


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text and any argparse details (choices, metavar, nargs, const) as metadata."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class TrainConfig:
    """Every setting of a training run; the defaults are the classic MNIST DataParallel tutorial's job."""

    model: str = _setting("simplenet", "the model to train", choices=MODEL_NAMES)
    dataset: str = _setting("digits", "the data: digits (offline), digits60k, mnist, random", choices=DATASET_NAMES)
    epochs: int = _setting(5, "passes over the training data")
    batch_size: int = _setting(
        64, "the global batch: samples per optimizer step, split across every device and process"
    )
    lr: float = _setting(0.01, "SGD learning rate")
    log_every: int = _setting(100, "print the loss every N steps", metavar="N")
    strategy: str = _setting(
        "auto",
        "how to run: single (one device), dp (several devices, one process), ddp (one process per device); "
        "auto: ddp under a launcher or over several GPUs, dp over a list of devices, else single",
        choices=STRATEGY_NAMES,
    )
    devices: str = _setting("auto", "auto, cpu, cuda, cuda:0,cuda:1, or cpu,cpu,cpu (CPU replicas)")
    seed: int = _setting(0, "seeds the weights, the shuffle order and every generator")
    data_dir: str | None = _setting(None, "where the mnist IDX files are, or get downloaded to", metavar="DIR")
    checkpoint_dir: str | None = _setting(None, "save a checkpoint there at the end of every epoch", metavar="DIR")
    checkpoint_every: int = _setting(0, "also save every N steps (0: only at epoch ends)", metavar="N")
    keep_checkpoints: int = _setting(3, "keep the newest K checkpoints", metavar="K")
    resume: str | None = _setting(
        None,
        "continue from the latest checkpoint in --checkpoint-dir (an error if there is none), from it only if "
        "one exists (if-exists), or from a given file",
        nargs="?",
        const="latest",
        metavar="latest|if-exists|PATH",
    )
    metrics_out: str | None = _setting(None, "write the results as JSON", metavar="FILE.json")
    quiet: bool = _setting(False, "no progress bar and no per-step lines")
    progress_bar: bool | None = _setting(None, "show a progress bar (default: when stderr is a terminal)")
    width: int = _setting(1024, "hidden width of --model mlp")
    depth: int = _setting(2, "hidden layers of --model mlp")
    max_steps: int | None = _setting(
        None, "stop after N optimizer steps of this invocation, restarts included (smoke runs)", metavar="N"
    )
    eval_batch_size: int = _setting(1024, "samples per batch when measuring test accuracy")
    timeout: float | None = _setting(
        None,
        f"ddp: seconds a collective may wait for the other ranks before failing (default {DEFAULT_TIMEOUT_S:g})",
        metavar="SECONDS",
    )

    def validate(self) -> None:
        """Raise ConfigError for settings no run can use, before any work starts."""
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"unknown model {self.model!r}; choose one of: {', '.join(MODEL_NAMES)}")
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASET_NAMES)}")
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
        checks = [
            (self.epochs >= 1, f"--epochs must be at least 1; found {self.epochs}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1; found {self.batch_size}"),
            (self.lr > 0, f"--lr must be positive; found {self.lr}"),
            (self.log_every >= 1, f"--log-every must be at least 1; found {self.log_every}"),
            (self.checkpoint_every >= 0, f"--checkpoint-every must be 0 or more; found {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1; found {self.keep_checkpoints}"),
            (self.width >= 1, f"--width must be at least 1; found {self.width}"),
            (self.depth >= 0, f"--depth must be 0 or more; found {self.depth}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be at least 1; found {self.max_steps}"),
            (self.eval_batch_size >= 1, f"--eval-batch-size must be at least 1; found {self.eval_batch_size}"),
            (self.timeout is None or self.timeout > 0, f"--timeout must be positive seconds; found {self.timeout}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.resume is not None and self.checkpoint_dir is None and self.resume in RESUME_MODES:
            raise ConfigError("--resume needs --checkpoint-dir (where to look for the latest checkpoint)")
