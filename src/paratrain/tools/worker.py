"""One rank of a ``ddp:N`` (or ``zero1:N``, ``zero2:N``, ``zero3:N``) configuration of verify or bench; started by
:func:`paratrain.tools.runner.run_config`.

    python -m torch.distributed.run --nproc-per-node 2 -m paratrain.tools.worker JOB.json

JOB.json names the function to run and the settings class by ``module:name`` path, the settings, extra inputs
and the folder each rank writes ``rank{R}.pt`` to (or ``rank{R}.error`` with the failure).
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from paratrain.environment import ClusterEnvironment
from paratrain.parallel import Parallel


def _imported(path: str) -> Any:
    module, _, name = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out"])
    rank = ClusterEnvironment.detect().rank
    try:
        settings = _imported(job["settings_class"]).from_dict(job["settings"], source=argv[0])
        run_in = _imported(job["run_in"])
        report = settings.hang_report or str(out / "hang-report.json")
        strategy = job.get("strategy", "ddp")
        with Parallel(
            strategy, "auto", timeout=settings.timeout, precision=settings.precision, hang_report=report
        ) as par:
            result = run_in(par, settings, job["extra"])
        torch.save(result, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}\n")
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
