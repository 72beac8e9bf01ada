"""``plan --validate``: is the prediction close to what ``bench`` then measures on this machine?

    configs = validation_configs(config.configs, config.max_world_size)
    report.validation = validate_plan(config, configs, predicted, max_error=0.15)

bench runs single and ddp:2..``VALIDATE_UP_TO`` (or ``--configs``) with plan's model, data and step counts;
each prediction's error is ``predicted / measured - 1``, within ``--max-error`` or not. What cannot run here is
reported with its reason, never as within.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paratrain.tools.bench import bench
from paratrain.tools.configs import RunConfig, parse_configs, unavailable_reason
from paratrain.tools.plan_runs import bench_settings
from paratrain.tools.settings import RunSettings

__all__ = ["VALIDATE_UP_TO", "validate_plan", "validation_configs"]

VALIDATE_UP_TO = 3  # --validate benches ddp up to this many processes by default


def validation_configs(words: list[str] | None, max_world_size: int) -> list[RunConfig]:
    """The configurations ``--validate`` benches: those given (single and ddp only), or single and ddp:2..3."""
    if words is not None:
        chosen = parse_configs(words)
    else:
        most = min(max_world_size, VALIDATE_UP_TO)
        chosen = parse_configs(["single", *(f"ddp:{n}" for n in range(2, most + 1))])
    return [c for c in chosen if c.strategy in ("single", "ddp")]


def validate_plan(
    settings: RunSettings, configs: list[RunConfig], predicted: Mapping[int, float], max_error: float
) -> list[dict[str, Any]]:
    """Bench ``configs`` with ``settings``' model, data, step and timing, and each prediction's error (one each).

    ``predicted`` maps a world size to its predicted step seconds; a world size it lacks is NOT PREDICTED.
    """
    measured = bench(bench_settings(settings, [c.word for c in configs]))
    results = []
    for c in configs:
        timing = measured.timing(c.word)
        entry: dict[str, Any] = {"config": c.word, "status": timing.status, "world_size": c.device_count}
        if timing.status != "OK" or unavailable_reason(c) is not None:
            entry.update(reason=timing.reason, within=None)
        elif c.device_count not in predicted:
            entry.update(status="NOT PREDICTED", within=None)
        else:
            prediction = predicted[c.device_count]
            error = prediction / timing.step_seconds - 1
            entry.update(
                predicted_seconds=prediction,
                measured_seconds=timing.step_seconds,
                measured_repeats=timing.repeat_step_seconds,
                error=error,
                within=abs(error) <= max_error,
            )
        results.append(entry)
    return results
