"""The other ranks of a world size, for ``paratrain plan`` on the CPU: ``python -m paratrain.tools.busy JOB.json``.

N ddp processes on one machine share more than its cores: memory bandwidth and caches too, so a process's step
is slower beside N - 1 others than alone, even with a core each (plan prints the factor it measured with its
assumptions). plan therefore measures each world size's compute while N - 1 of these
processes run the same training steps (the model, per-device batch and thread count of that world size). Each
prints ``ready`` after its warm-up steps and then steps until it is terminated. JOB.json holds ``settings`` (the
plan's settings as a dict), ``batch`` and ``threads``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

import torch

from paratrain.tools.plan_measure import ProfileRun
from paratrain.tools.settings import RunSettings
from paratrain.tools.workload import Workload

__all__ = ["main"]

_WARMUP = 3


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m paratrain.tools.busy JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    names = {f.name for f in fields(RunSettings)}
    settings = RunSettings(**{k: v for k, v in job["settings"].items() if k in names})
    torch.set_num_threads(int(job["threads"]))
    run = ProfileRun(Workload.load(settings), torch.device("cpu"), int(job["batch"]), int(job["threads"]))
    for _ in range(_WARMUP):
        run.step(record=False)
    print("ready", flush=True)
    while True:  # until plan terminates this process
        run.step(record=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
