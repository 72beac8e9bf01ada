"""The settings ``verify``, ``bench`` and ``plan`` share: the model, the data, the step, the configurations.

Each command's settings class derives from :class:`RunSettings` and adds its own fields; the flags of
``paratrain verify/bench/plan`` are generated from those fields (see ``cli/options.py``), so the Python API and
the command line take the same names with the same defaults::

    VerifyConfig(model="mlp", batch_size=32, configs=["single", "ddp:2"]).validate()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import ConfigError
from ..precision import PRECISIONS
from ..training.datasets import DATASET_NAMES
from ..training.model_spec import MODEL_SPEC_HELP
from ..training.optimizers import OPTIMIZERS
from .configs import parse_configs

__all__ = ["LOSS_REDUCTIONS", "RunSettings", "parse_input_shape", "setting", "settings_from"]

LOSS_REDUCTIONS = ("mean", "sum")
DEFAULT_RUN_TIMEOUT_S = 600.0


S = TypeVar("S", bound="RunSettings")


def settings_from(cls: type[S], config: S | None, settings: dict[str, Any]) -> S:
    """The settings ``verify(config)`` or ``verify(**settings)`` was called with, checked.

    Raises:
        ConfigError: both a settings object and keyword settings, or settings no run can use.
    """
    if config is None:
        config = cls(**settings)
    elif settings:
        raise ConfigError(f"pass either a {cls.__name__} or keyword settings, not both")
    config.validate_settings()
    return config


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text and any argparse details (choices, metavar, nargs) as metadata."""
    return field(default=default, metadata={"help": help, **cli})


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``3,32,32`` -> (3, 32, 32).

    Raises:
        ConfigError: anything but comma-separated positive integers.
    """
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--input-shape: expected positive integers separated by commas, such as 3,32,32; found {text!r}"
        )
    return tuple(int(p) for p in parts)


@dataclass
class RunSettings:
    """What every configuration runs: the same model, data and step."""

    model: str = setting("simplenet", MODEL_SPEC_HELP, metavar="NAME|module:callable")
    width: int = setting(1024, "hidden width of --model mlp")
    depth: int = setting(2, "hidden layers of --model mlp")
    dataset: str | None = setting(
        None,
        f"a built-in dataset ({', '.join(DATASET_NAMES)}); default digits, or random tensors when --input-shape "
        "is given",
        metavar="NAME",
    )
    data_dir: str | None = setting(None, "where the mnist IDX files are, or get downloaded to", metavar="DIR")
    input_shape: str | None = setting(
        None, "random inputs of this shape per sample (e.g. 3,32,32) instead of a dataset", metavar="D1,D2,..."
    )
    num_classes: int = setting(10, "classes of the random targets with --input-shape")
    batch_size: int = setting(64, "the global batch: samples per optimizer step, split across every device")
    loss: str = setting(
        "mean",
        "how the cross-entropy loss reduces over a batch: mean, or sum (check what sum does to your gradients)",
        choices=LOSS_REDUCTIONS,
    )
    optimizer: str = setting("sgd", "the optimizer, with torch's defaults", choices=OPTIMIZERS)
    lr: float = setting(0.01, "learning rate")
    precision: str = setting("32", "numeric precision: 32, bf16-mixed or 16-mixed", choices=PRECISIONS)
    accumulate: int = setting(1, "micro-batches per optimizer step; --batch-size stays the global batch per step")
    seed: int = setting(0, "seeds the initial weights, the random data and the shuffle order")
    configs: list[str] | None = field(
        default=None,
        metadata={
            "help": "configurations as separate words: single, dp:cpu,cpu,cpu, dp:cuda:0,cuda:1, ddp:2, ... "
            "(default: every configuration this machine can run, up to 3 devices)",
            "nargs": "+",
            "metavar": "CONFIG",
        },
    )
    report_out: str | None = setting(None, "write the report as JSON", metavar="FILE.json")
    timeout: float = setting(
        DEFAULT_RUN_TIMEOUT_S, "seconds one ddp configuration may run before its processes are stopped"
    )

    def validate(self) -> None:
        """Raise ConfigError for settings no run can use, before any work starts."""
        self.validate_settings()

    def validate_settings(self) -> None:
        """What :meth:`validate` checks, under a name that ``PlanConfig`` keeps (its ``validate`` is the
        ``--validate`` switch); subclasses extend this one."""
        if self.dataset is not None and self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASET_NAMES)}")
        if self.dataset is not None and self.input_shape is not None:
            raise ConfigError(
                f"--dataset {self.dataset} and --input-shape {self.input_shape} both say where the data comes from; "
                "give one of them"
            )
        if self.input_shape is not None:
            parse_input_shape(self.input_shape)
        _one_of("--optimizer", self.optimizer, OPTIMIZERS)
        _one_of("--precision", self.precision, PRECISIONS)
        if self.loss not in LOSS_REDUCTIONS:
            raise ConfigError(f"--loss: expected one of {', '.join(LOSS_REDUCTIONS)}; found {self.loss!r}")
        checks = [
            (self.width >= 1, f"--width must be at least 1; found {self.width}"),
            (self.depth >= 0, f"--depth must be 0 or more; found {self.depth}"),
            (self.num_classes >= 2, f"--num-classes must be at least 2; found {self.num_classes}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1; found {self.batch_size}"),
            (
                1 <= self.accumulate <= self.batch_size,
                f"--accumulate must be from 1 to --batch-size ({self.batch_size}); found {self.accumulate}",
            ),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be a positive number; found {self.lr}"),
            (self.timeout > 0, f"--timeout must be positive seconds; found {self.timeout}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        parse_configs(self.configs)  # a bad word is a usage error before anything runs


def _one_of(flag: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{flag}: expected one of {', '.join(choices)}; found {value!r}")
