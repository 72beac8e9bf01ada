"""Run one configuration of ``verify`` or ``bench``: in this process (single, dp) or in launched processes (ddp, zero).

    results = run_config(run_in, settings, parse_config("ddp:2"), workdir, extra)   # one dict per rank

Every configuration runs the same function, ``run_in(par, settings, extra) -> dict``, under ``Parallel``: here for
single and dp, and for ``ddp:N`` in N processes that :func:`paratrain.launch.launcher.launch` starts running
:mod:`paratrain.tools.worker`, which imports the function and the settings class by their ``module:name`` paths.
Each rank saves its result to a file this process reads; a rank that fails leaves its error there, so the report
can say what went wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import DistributedError, ParatrainError
from paratrain.launch.launcher import LaunchConfig, launch
from paratrain.parallel import Parallel
from paratrain.tools.configs import RunConfig
from paratrain.tools.settings import RunSettings

__all__ = ["ConfigRunError", "RunIn", "path_of", "run_config"]

RunIn = Callable[[Parallel, Any, dict[str, Any]], dict[str, Any]]


class ConfigRunError(ParatrainError, RuntimeError):
    """A configuration could not run to the end (a rank failed, or the job timed out)."""


def path_of(obj: Any) -> str:
    """``module:qualified.name`` of a module-level function or class, as :mod:`paratrain.tools.worker` imports it."""
    return f"{obj.__module__}:{obj.__qualname__}"


def run_config(
    run_in: RunIn, settings: RunSettings, config: RunConfig, workdir: Path, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Run ``run_in`` under ``config``; each rank's result, in rank order (one entry in this process).

    Raises:
        ConfigRunError: a rank raised, or the processes did not finish within ``settings.run_timeout``.
    """
    if config.in_process:
        try:
            with Parallel(config.strategy, ",".join(config.devices), precision=settings.precision) as par:
                return [run_in(par, settings, extra)]
        except ParatrainError:
            raise
        except Exception as exc:  # the user's model may raise anything: the report names it
            raise ConfigRunError(f"{type(exc).__name__}: {exc}") from exc
    name = run_in.__module__.rsplit(".", 1)[-1]
    out = workdir / f"{name}-{config.word.replace(':', '-').replace(',', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    job = out / "job.json"
    job.write_text(
        json.dumps(
            {
                "run_in": path_of(run_in),
                "strategy": config.strategy,
                "settings_class": path_of(type(settings)),
                "settings": settings.to_dict(),
                "extra": extra,
                "out": str(out),
            }
        )
    )
    try:
        code = launch(
            LaunchConfig(nproc_per_node=config.processes),
            "paratrain.tools.worker",
            [str(job)],
            module=True,
            timeout=settings.run_timeout,
            name=f"paratrain {config.word}",
        )
    except DistributedError as exc:
        raise ConfigRunError(f"{config.word}: {exc}") from exc
    errors = sorted(out.glob("rank*.error"))
    if errors:
        first = errors[0]
        raise ConfigRunError(f"{first.stem.replace('rank', 'rank ')}: {first.read_text().strip()}")
    if code != 0:
        raise ConfigRunError(
            f"the {config.processes} processes exited with code {code} (the lines above name each failed rank)"
        )
    results = []
    for rank in range(config.processes):
        path = out / f"rank{rank}.pt"
        if not path.exists():
            raise ConfigRunError(f"rank {rank} wrote no result to {path}")
        results.append(torch.load(path, weights_only=False))
    return results
