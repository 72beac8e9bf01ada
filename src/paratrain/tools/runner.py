"""Run one configuration of ``verify`` or ``bench``: in this process (single, dp) or in launched processes (ddp).

    results = run_config("verify", settings, parse_config("ddp:2"), workdir, extra)   # one dict per rank

Every configuration runs the same function, ``run_in(par, settings, extra)`` of the mode's module, under
``Parallel``: here for single and dp, and for ``ddp:N`` in N processes that :func:`paratrain.launch.launch`
starts running :mod:`paratrain.tools.worker`. Each rank saves its result to a file this process reads; a rank
that fails leaves its error there, so the report can say what went wrong.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..errors import DistributedError, ParatrainError
from ..launch import LaunchConfig, launch
from ..parallel import Parallel
from .configs import RunConfig
from .settings import RunSettings

__all__ = ["MODES", "ConfigRunError", "run_config", "run_mode"]

# mode -> the module that has SETTINGS (its settings class) and run_in(par, settings, extra) -> dict
MODES = {"verify": "paratrain.tools.verify", "bench": "paratrain.tools.bench"}


class ConfigRunError(ParatrainError, RuntimeError):
    """A configuration could not run to the end (a rank failed, or the job timed out)."""


def run_mode(mode: str, par: Parallel, settings: RunSettings, extra: dict[str, Any]) -> dict[str, Any]:
    module = importlib.import_module(MODES[mode])
    result: dict[str, Any] = module.run_in(par, settings, extra)
    return result


def settings_class(mode: str) -> type[RunSettings]:
    cls: type[RunSettings] = importlib.import_module(MODES[mode]).SETTINGS
    return cls


def run_config(
    mode: str, settings: RunSettings, config: RunConfig, workdir: Path, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Run ``mode`` under ``config``; each rank's result, in rank order (one entry in this process).

    Raises:
        ConfigRunError: a rank raised, or the processes did not finish within ``settings.timeout``.
    """
    if config.in_process:
        try:
            with Parallel(config.strategy, ",".join(config.devices), precision=settings.precision) as par:
                return [run_mode(mode, par, settings, extra)]
        except ParatrainError:
            raise
        except Exception as exc:  # the user's model may raise anything: the report names it
            raise ConfigRunError(f"{type(exc).__name__}: {exc}") from exc
    out = workdir / f"{mode}-{config.word.replace(':', '-').replace(',', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    job = out / "job.json"
    job.write_text(json.dumps({"mode": mode, "settings": asdict(settings), "extra": extra, "out": str(out)}))
    try:
        code = launch(
            LaunchConfig(nproc_per_node=config.processes),
            "paratrain.tools.worker",
            [str(job)],
            module=True,
            timeout=settings.timeout,
        )
    except DistributedError as exc:
        raise ConfigRunError(f"{config.word}: {exc}") from exc
    errors = sorted(out.glob("rank*.error"))
    if errors:
        first = errors[0]
        raise ConfigRunError(f"{first.stem.replace('rank', 'rank ')}: {first.read_text().strip()}")
    if code != 0:
        raise ConfigRunError(f"the {config.processes} processes exited with code {code} (torchrun's summary above)")
    results = []
    for rank in range(config.processes):
        path = out / f"rank{rank}.pt"
        if not path.exists():
            raise ConfigRunError(f"rank {rank} wrote no result to {path}")
        results.append(torch.load(path, weights_only=False))
    return results
