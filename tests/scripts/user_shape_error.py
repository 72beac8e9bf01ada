"""A user's script whose ranks build different models, catch paratrain's error and exit with their own code.

    torchrun --standalone --nproc-per-node 2 user_shape_error.py --api ddp --exit-code 7

--api ddp: paratrain.DistributedDataParallel over the user's own init_process_group; --api zero2: Parallel("zero2")
prepare. Rank 1's first layer has 6 outputs where rank 0's has 5. Each rank prints the DistributedError and exits
with --exit-code (issue 24: a rank died with SIGABRT at exit instead, "terminate called without an active exception").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import paratrain


def _model(rank: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 6 if rank == 1 else 5), torch.nn.Linear(6 if rank == 1 else 5, 2))


def _wrap(api: str, rank: int) -> None:
    if api == "ddp":
        dist.init_process_group("gloo")
        paratrain.DistributedDataParallel(_model(rank), timeout=30)
        return
    par = paratrain.Parallel(api, timeout=30)
    model = _model(rank)
    par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["ddp", "zero2"], default="ddp")
    parser.add_argument("--exit-code", type=int, default=7)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    try:
        _wrap(args.api, rank)
    except paratrain.DistributedError as exc:
        print(f"user_shape_error: rank {rank} caught: {exc}", flush=True)
        return args.exit_code
    print(f"user_shape_error: rank {rank}: no error", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
