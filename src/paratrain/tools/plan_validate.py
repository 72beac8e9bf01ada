"""``plan --validate``: is the prediction close to what ``bench`` then measures on this machine?

    report.validation = validate_plan(config, report)   # one entry per configuration: predicted, measured, error

bench runs single and ddp:2..``VALIDATE_UP_TO`` (or ``--configs``) with plan's model, data and step counts;
each prediction's error is ``predicted / measured - 1``, within ``--max-error`` or not. What cannot run here is
reported with its reason, never as within.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .bench import BenchConfig, bench
from .configs import RunConfig, parse_configs, unavailable_reason
from .settings import RunSettings

if TYPE_CHECKING:
    from .plan import PlanConfig, PlanReport

__all__ = ["VALIDATE_UP_TO", "validate_plan"]

VALIDATE_UP_TO = 3  # --validate benches ddp up to this many processes by default


def _validation_configs(config: PlanConfig) -> list[RunConfig]:
    if config.configs is not None:
        chosen = parse_configs(config.configs)
    else:
        most = min(config.max_world_size, VALIDATE_UP_TO)
        chosen = parse_configs(["single", *(f"ddp:{n}" for n in range(2, most + 1))])
    return [c for c in chosen if c.strategy in ("single", "ddp")]


def validate_plan(config: PlanConfig, report: PlanReport) -> list[dict[str, Any]]:
    """``plan --validate``: bench what this machine runs and each prediction's error against it (one entry each)."""
    configs = _validation_configs(config)
    shared = {f: getattr(config, f) for f in RunSettings.__dataclass_fields__ if f not in ("configs", "report_out")}
    measured = bench(
        BenchConfig(
            **shared,
            configs=[c.word for c in configs],
            warmup=config.warmup,
            steps=config.steps,
            repeats=config.repeats,
        )
    )
    results = []
    for c in configs:
        timing = measured.timing(c.word)
        entry: dict[str, Any] = {"config": c.word, "status": timing.status, "world_size": c.device_count}
        if timing.status != "OK" or unavailable_reason(c) is not None:
            entry.update(reason=timing.reason, within=None)
        elif c.device_count > config.max_world_size:
            entry.update(status="NOT PREDICTED", within=None)
        else:
            predicted = report.row(c.device_count).step_seconds
            error = predicted / timing.step_seconds - 1
            entry.update(
                predicted_seconds=predicted,
                measured_seconds=timing.step_seconds,
                measured_repeats=timing.repeat_step_seconds,
                error=error,
                within=abs(error) <= config.max_error,
            )
        results.append(entry)
    return results
