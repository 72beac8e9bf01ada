"""A user's script in which rank 0 makes a call its peer does not (issue 27).

    paratrain launch --nproc-per-node 2 user_skipped.py --call extra --timeout 3

--call extra     rank 0 makes a torch.distributed all-reduce of its own (a gradient bucket's size), rank 1 does not
                 and finishes its steps
--call barrier   rank 0 calls par.barrier() under ``if par.is_main:``
--call all_reduce  rank 0 calls par.all_reduce(t) under ``if par.rank == 0:`` (a metric of another size than a bucket)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import paratrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--call", choices=["extra", "barrier", "all_reduce"], default="extra")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    par = paratrain.Parallel("ddp", timeout=args.timeout)
    model = par.prepare(torch.nn.Linear(4, 2))
    x = torch.randn(8, 4)
    for step in range(3):
        loss = model(x).sum()
        if step == 1 and par.rank == 0:
            if args.call == "extra":
                dist.all_reduce(torch.ones(10))  # the collective only rank 0 makes
            elif args.call == "barrier":
                par.barrier()  # the paratrain call only rank 0 makes
            else:
                par.all_reduce(torch.ones(3))  # the metric only rank 0 all-reduces
        par.backward(loss)
    print(f"rank {par.rank} finished", flush=True)


if __name__ == "__main__":
    main()
