"""One rank of a ``ddp:N`` configuration of verify or bench; started by :func:`paratrain.tools.runner.run_config`.

    python -m torch.distributed.run --nproc-per-node 2 -m paratrain.tools.worker JOB.json

JOB.json names the mode, its settings, extra inputs and the folder each rank writes ``rank{R}.pt`` to (or
``rank{R}.error`` with the failure).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from ..parallel import Parallel
from .runner import run_mode, settings_class


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out"])
    rank = int(os.environ.get("RANK", "0"))
    try:
        settings = settings_class(job["mode"])(**job["settings"])
        with Parallel("ddp", "auto", timeout=float(settings.timeout)) as par:
            result = run_mode(job["mode"], par, settings, job["extra"])
        torch.save(result, out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}\n")
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
