"""The settings groups every command composes: model, data, optimizer, step, collectives. Each setting once.

``paratrain train`` (:class:`~paratrain.training.config.TrainConfig`) and ``verify``, ``bench`` and ``plan``
(:class:`~paratrain.tools.settings.RunSettings`) derive from these groups, so a flag the commands share is one
field, with one default, one help text and one check (a test holds them to it)::

    @dataclass
    class TrainConfig(ModelSettings, DataSettings, OptimizerSettings, StepSettings, ...):
        epochs: int = setting(5, "passes over the training data", check=at_least(1))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.comm.collectives import DEFAULT_TIMEOUT_S
from paratrain.errors import ConfigError
from paratrain.files import check_input_dir
from paratrain.loop.precision import PRECISIONS
from paratrain.settings import Settings, at_least, below, finite_positive, one_of, optional, positive, setting
from paratrain.training.data import parse_input_shape
from paratrain.training.datasets import DATASET_NAMES
from paratrain.training.model_spec import MODEL_SPEC_HELP, check_model_spec, is_model_spec
from paratrain.training.models import MODEL_NAMES
from paratrain.training.optimizers import DEFAULT_BETAS, OPTIMIZERS

__all__ = [
    "CollectiveSettings",
    "DataSettings",
    "ModelSettings",
    "OptimizerSettings",
    "StepSettings",
]

# an optimizer update is lr times a gradient in float32: a larger lr overflows before training can even diverge
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass
class ModelSettings(Settings):
    """Which model: a built-in one (and the mlp's size) or the user's own callable."""

    model: str = setting("simplenet", MODEL_SPEC_HELP, metavar="NAME|module:callable")
    width: int = setting(1024, "hidden width of --model mlp", check=at_least(1))
    depth: int = setting(2, "hidden layers of --model mlp", check=at_least(0))

    def check_group(self) -> None:
        if is_model_spec(self.model):
            check_model_spec(self.model)
        elif self.model not in MODEL_NAMES:
            raise ConfigError(
                f"unknown model {self.model!r}; choose one of: {', '.join(MODEL_NAMES)}, or give your own as "
                f"module.path:callable"
            )


@dataclass
class DataSettings(Settings):
    """Where the samples come from: a built-in dataset, or random tensors of a given shape."""

    dataset: str | None = setting(
        None,
        f"the data: {', '.join(DATASET_NAMES)} (default digits, or random tensors when --input-shape is given)",
        check=optional(one_of(DATASET_NAMES)),
        metavar="NAME",
    )
    data_dir: str | None = setting(None, "where the mnist IDX files are, or get downloaded to", metavar="DIR")
    verify_data: bool = setting(
        True,
        "check MNIST files found in --data-dir as downloads are checked (gzipped: their published md5; plain: the "
        "release's label counts and brightness); --no-verify-data trains on a deliberately different copy",
    )
    input_shape: str | None = setting(
        None, "random inputs of this shape per sample (e.g. 3,32,32) instead of a dataset", metavar="D1,D2,..."
    )
    num_classes: int = setting(10, "classes of the random targets with --input-shape", check=at_least(2))

    @property
    def dataset_name(self) -> str:
        """The dataset the run uses: the one named, else random with ``--input-shape``, else digits."""
        if self.dataset is not None:
            return self.dataset
        return "random" if self.input_shape is not None else "digits"

    def check_group(self) -> None:
        if self.dataset is not None and self.input_shape is not None:
            raise ConfigError(
                f"--dataset {self.dataset} and --input-shape {self.input_shape} both say where the data comes from; "
                "give one of them"
            )
        if self.input_shape is not None:
            parse_input_shape(self.input_shape)
        if self.data_dir is not None and self.dataset_name == "mnist":
            check_input_dir(self.data_dir, "--data-dir")


@dataclass
class OptimizerSettings(Settings):
    """The optimizer and its hyper-parameters (torch's defaults where not given)."""

    optimizer: str = setting("sgd", "the optimizer", check=one_of(OPTIMIZERS), choices=OPTIMIZERS)
    lr: float = setting(0.01, "learning rate (the peak of --lr-schedule cosine)", check=below(_FLOAT32_MAX))
    momentum: float = setting(0.0, "sgd momentum", check=at_least(0))
    weight_decay: float | None = setting(
        None,
        "decoupled weight decay for adamw, L2 penalty for sgd (default: 0.01 for adamw, 0 for sgd)",
        check=optional(at_least(0)),
    )
    betas: tuple[float, float] = setting(
        DEFAULT_BETAS,
        f"adamw's two moment decay rates (default {DEFAULT_BETAS[0]},{DEFAULT_BETAS[1]})",
        check=lambda b: None if len(b) == 2 and all(0 <= x < 1 for x in b) else "two numbers in [0, 1)",
        metavar="B1,B2",
    )

    def check_group(self) -> None:
        if self.optimizer != "sgd" and self.momentum != 0:
            raise ConfigError(f"--momentum is for --optimizer sgd; {self.optimizer} takes --betas instead")
        if self.optimizer != "adamw" and tuple(self.betas) != DEFAULT_BETAS:
            raise ConfigError(f"--betas is for --optimizer adamw; {self.optimizer} takes --momentum instead")


@dataclass
class StepSettings(Settings):
    """What one optimizer step does: its global batch, micro-batches, precision, clipping, and the seed."""

    batch_size: int = setting(
        64,
        "the global batch: samples per optimizer step, split across every device and process (and, with "
        "--accumulate K, into K micro-batches)",
        check=at_least(1),
    )
    accumulate: int = setting(
        1,
        "micro-batches per optimizer step: each process's share of every global batch is cut into K "
        "micro-batches (sizes differ by at most one), only the last synchronises gradients, and the step is "
        "on the whole --batch-size: --batch-size 64 --accumulate 4 steps on 64 samples as 4 micro-batches of 16",
        check=at_least(1),
        metavar="K",
    )
    precision: str = setting(
        "32",
        "32 (float32), bf16-mixed or 16-mixed (forward passes under autocast; 16-mixed also scales the loss "
        "and skips steps whose gradients overflow)",
        check=one_of(PRECISIONS),
        choices=PRECISIONS,
    )
    clip_grad_norm: float | None = setting(
        None,
        "clip the global gradient's norm to X before every optimizer step",
        check=optional(positive()),
        metavar="X",
    )
    seed: int = setting(0, "seeds the weights, the shuffle order, the random data and every generator")

    def check_group(self) -> None:
        if self.batch_size < self.accumulate:
            raise ConfigError(
                f"--accumulate {self.accumulate} cuts each global batch into {self.accumulate} micro-batches, so "
                f"--batch-size must be at least {self.accumulate}; found {self.batch_size}"
            )


@dataclass
class CollectiveSettings(Settings):
    """How long a collective may wait for the other processes."""

    timeout: float | None = setting(
        None,
        f"ddp: seconds a collective may wait for the other ranks before failing (default {DEFAULT_TIMEOUT_S:g})",
        check=optional(finite_positive),
        metavar="SECONDS",
    )
    hang_report: str | None = setting(
        None,
        "ddp: where the report of every rank goes (JSON) when a collective times out or ranks call different "
        "collectives (default: beside the run's outputs, or paratrain-hang-report.json here)",
        metavar="FILE.json",
    )
