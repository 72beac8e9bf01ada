"""The settings ``verify``, ``bench`` and ``plan`` share: the groups ``train`` has too, and the configurations.

Each command's settings class derives from :class:`RunSettings` and adds its own fields; the flags of
``paratrain verify/bench/plan`` are generated from those fields (see ``cli/options.py``), and the fields they share
with ``paratrain train`` are the same fields (:mod:`paratrain.training.settings`), so the Python API and every
command line take the same names with the same defaults, help and checks::

    VerifyConfig(model="mlp", batch_size=32, configs=["single", "ddp:2"]).check()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from paratrain.errors import ConfigError
from paratrain.files import check_output
from paratrain.settings import Settings, at_least, one_of, positive, setting
from paratrain.tools.configs import parse_configs
from paratrain.training.settings import CollectiveSettings, DataSettings, ModelSettings, OptimizerSettings, StepSettings

__all__ = ["DEFAULT_RUN_TIMEOUT_S", "LOSS_REDUCTIONS", "RunSettings", "ToolSettings", "settings_from"]

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
    config.check()
    return config


@dataclass
class ToolSettings(Settings):
    """What the three tools add: the loss's reduction, the configurations, the report, a limit per configuration."""

    loss: str = setting(
        "mean",
        "how the cross-entropy loss reduces over a batch: mean, or sum (check what sum does to your gradients)",
        check=one_of(LOSS_REDUCTIONS),
        choices=LOSS_REDUCTIONS,
    )
    configs: list[str] | None = setting(
        None,
        "configurations as separate words: single, dp:cpu,cpu,cpu, dp:cuda:0,cuda:1, ddp:2, ... "
        "(default: every configuration this machine can run, up to 3 devices)",
        nargs="+",
        metavar="CONFIG",
    )
    steps: int = setting(
        10,
        "optimizer steps each configuration runs: verify compares every one with single, bench and plan time them "
        "(after --warmup untimed ones)",
        check=at_least(1),
    )
    report_out: str | None = setting(None, "write the report as JSON", metavar="FILE.json")
    run_timeout: float = setting(
        DEFAULT_RUN_TIMEOUT_S,
        "seconds one ddp configuration may run before its processes are stopped",
        check=positive("seconds"),
        metavar="SECONDS",
    )

    def check_group(self) -> None:
        parse_configs(self.configs)  # a bad word is a usage error before anything runs
        if self.report_out is not None:
            check_output(self.report_out, "--report-out")  # before the runs, not after them


@dataclass
class TimingSettings(Settings):
    """How bench and plan time a configuration: untimed steps first, then round-robin repeats."""

    warmup: int = setting(3, "untimed steps before each timed run", check=at_least(0))
    repeats: int = setting(
        3,
        "timed runs of each configuration, round robin; the report takes medians (plan: rounds of its own "
        "measurements, whose medians must agree, and of bench with --validate)",
        check=at_least(1),
    )


@dataclass
class RunSettings(ToolSettings, CollectiveSettings, StepSettings, OptimizerSettings, DataSettings, ModelSettings):
    """What every configuration of verify, bench and plan runs: the same model, data and step."""
