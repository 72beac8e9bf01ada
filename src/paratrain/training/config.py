"""Every setting of a training run, defined once: the fields, their defaults, their help and their checks.

``paratrain train``'s flags are generated from :class:`TrainConfig` (``--batch-size`` is ``batch_size``), so a flag
cannot drift from its default or its help. The defaults are the classic MNIST DataParallel tutorial's job:
SimpleNet, batch 64, SGD with learning rate 0.01, 5 epochs.

    config = TrainConfig(epochs=1, strategy="dp", devices="cpu,cpu,cpu")
    config.validate()              # ConfigError naming the flag, before any work starts
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..collectives import DEFAULT_TIMEOUT_S
from ..errors import ConfigError
from ..files import check_output
from ..precision import PRECISIONS
from ..strategies import STRATEGY_NAMES
from .datasets import DATASET_NAMES
from .logs import check_extras
from .model_spec import MODEL_SPEC_HELP, check_model_spec, is_model_spec
from .models import MODEL_NAMES
from .optimizers import DEFAULT_BETAS, LR_SCHEDULES, OPTIMIZERS

__all__ = ["RESUME_MODES", "TrainConfig"]

RESUME_MODES = ("latest", "if-exists")
# an optimizer update is lr times a gradient in float32: a larger lr overflows before training can even diverge
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text and any argparse details (choices, metavar, nargs, const) as metadata."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class TrainConfig:
    """Every setting of a training run; the defaults are the classic MNIST DataParallel tutorial's job."""

    model: str = _setting(
        "simplenet",
        MODEL_SPEC_HELP,
        metavar="NAME|module:callable",
    )
    dataset: str = _setting("digits", "the data: digits (offline), digits60k, mnist, random", choices=DATASET_NAMES)
    epochs: int = _setting(5, "passes over the training data")
    batch_size: int = _setting(
        64,
        "the global batch: samples per optimizer step, split across every device and process (and, with "
        "--accumulate K, into K micro-batches)",
    )
    lr: float = _setting(0.01, "learning rate (the peak of --lr-schedule cosine)")
    optimizer: str = _setting("sgd", "the optimizer", choices=OPTIMIZERS)
    momentum: float = _setting(0.0, "sgd momentum")
    weight_decay: float | None = _setting(
        None, "decoupled weight decay for adamw, L2 penalty for sgd (default: 0.01 for adamw, 0 for sgd)"
    )
    betas: tuple[float, float] = _setting(
        DEFAULT_BETAS,
        f"adamw's two moment decay rates (default {DEFAULT_BETAS[0]},{DEFAULT_BETAS[1]})",
        metavar="B1,B2",
    )
    lr_schedule: str = _setting(
        "constant", "constant, or cosine decay to 0 over the run's optimizer steps", choices=LR_SCHEDULES
    )
    warmup_steps: int = _setting(0, "raise the learning rate linearly from 0 over the first N steps", metavar="N")
    clip_grad_norm: float | None = _setting(
        None, "clip the global gradient's norm to X before every optimizer step", metavar="X"
    )
    precision: str = _setting(
        "32",
        "32 (float32), bf16-mixed or 16-mixed (forward passes under autocast; 16-mixed also scales the loss "
        "and skips steps whose gradients overflow)",
        choices=PRECISIONS,
    )
    accumulate: int = _setting(
        1,
        "micro-batches per optimizer step: each process's share of every global batch is cut into K "
        "micro-batches (sizes differ by at most one), only the last synchronises gradients, and the step is "
        "on the whole --batch-size: --batch-size 64 --accumulate 4 steps on 64 samples as 4 micro-batches of 16",
        metavar="K",
    )
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
    verify_data: bool = _setting(
        True,
        "check MNIST files found in --data-dir as downloads are checked (gzipped: their published md5; plain: the "
        "release's label counts and brightness); --no-verify-data trains on a deliberately different copy",
    )
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
    log_dir: str | None = _setting(
        None,
        "write TensorBoard event files, metrics.csv and curves.png there (from rank 0 only)",
        metavar="DIR",
    )
    tensorboard: bool | None = _setting(
        None, "with --log-dir, write TensorBoard event files (default: yes; needs paratrain[tensorboard])"
    )
    plot: bool | None = _setting(None, "with --log-dir, draw curves.png (default: yes; needs paratrain[plot])")
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
        if is_model_spec(self.model):
            check_model_spec(self.model)
        elif self.model not in MODEL_NAMES:
            raise ConfigError(
                f"unknown model {self.model!r}; choose one of: {', '.join(MODEL_NAMES)}, or give your own as "
                f"module.path:callable"
            )
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASET_NAMES)}")
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {self.strategy!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
        for name, value, choices in (
            ("--precision", self.precision, PRECISIONS),
            ("--optimizer", self.optimizer, OPTIMIZERS),
            ("--lr-schedule", self.lr_schedule, LR_SCHEDULES),
        ):
            if value not in choices:
                raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
        checks = [
            (self.epochs >= 1, f"--epochs must be at least 1; found {self.epochs}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1; found {self.batch_size}"),
            (0 < self.lr < _FLOAT32_MAX, f"--lr must be positive and below {_FLOAT32_MAX:.1e}; found {self.lr}"),
            (self.log_every >= 1, f"--log-every must be at least 1; found {self.log_every}"),
            (self.checkpoint_every >= 0, f"--checkpoint-every must be 0 or more; found {self.checkpoint_every}"),
            (self.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1; found {self.keep_checkpoints}"),
            (self.width >= 1, f"--width must be at least 1; found {self.width}"),
            (self.depth >= 0, f"--depth must be 0 or more; found {self.depth}"),
            (self.max_steps is None or self.max_steps >= 1, f"--max-steps must be at least 1; found {self.max_steps}"),
            (self.eval_batch_size >= 1, f"--eval-batch-size must be at least 1; found {self.eval_batch_size}"),
            (self.timeout is None or self.timeout > 0, f"--timeout must be positive seconds; found {self.timeout}"),
            (
                self.accumulate >= 1,
                f"--accumulate must be at least 1 (micro-batches per step); found {self.accumulate}",
            ),
            (
                self.batch_size >= self.accumulate,
                f"--accumulate {self.accumulate} cuts each global batch into {self.accumulate} micro-batches, so "
                f"--batch-size must be at least {self.accumulate}; found {self.batch_size}",
            ),
            (self.momentum >= 0, f"--momentum must be 0 or more; found {self.momentum}"),
            (
                self.weight_decay is None or self.weight_decay >= 0,
                f"--weight-decay must be 0 or more; found {self.weight_decay}",
            ),
            (
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"--betas must be two numbers in [0, 1), such as 0.9,0.999; found {self.betas}",
            ),
            (self.warmup_steps >= 0, f"--warmup-steps must be 0 or more; found {self.warmup_steps}"),
            (
                self.clip_grad_norm is None or self.clip_grad_norm > 0,
                f"--clip-grad-norm must be positive; found {self.clip_grad_norm}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.optimizer != "sgd" and self.momentum != 0:
            raise ConfigError(f"--momentum is for --optimizer sgd; {self.optimizer} takes --betas instead")
        if self.optimizer != "adamw" and tuple(self.betas) != DEFAULT_BETAS:
            raise ConfigError(f"--betas is for --optimizer adamw; {self.optimizer} takes --momentum instead")
        self._check_log_dir()
        if self.resume is not None and self.checkpoint_dir is None and self.resume in RESUME_MODES:
            raise ConfigError("--resume needs --checkpoint-dir (where to look for the latest checkpoint)")

    def check_outputs(self) -> None:
        """Check that every file and directory the run writes can be written, before any work starts.

        Called where the run's results are written: by ``paratrain train`` for a run on this machine, and by the
        main process before its first step.

        Raises:
            ConfigError: naming the flag and what is wrong with its path.
        """
        if self.metrics_out is not None:
            check_output(self.metrics_out, "--metrics-out")
        for flag, directory in (("--checkpoint-dir", self.checkpoint_dir), ("--log-dir", self.log_dir)):
            if directory is not None:
                check_output(Path(directory) / ".paratrain-check", flag)

    def _check_log_dir(self) -> None:
        for name, value in (("--tensorboard", self.tensorboard), ("--plot", self.plot)):
            if value and self.log_dir is None:
                raise ConfigError(f"{name} writes into --log-dir; add --log-dir DIR")
        if self.log_dir is None:
            return
        path = Path(self.log_dir)
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--log-dir {self.log_dir} is a file; give a directory (it is created if missing)")
        check_extras(tensorboard=self.tensorboard is not False, plot=self.plot is not False)
