"""A user's script in which one rank stalls (issue: the whole job must still end soon after the timeout).

    torchrun --nproc-per-node 2 user_hang.py --api ddp --fault sleep --timeout 3

--api ddp: paratrain.DistributedDataParallel over the user's own init_process_group; --api parallel: Parallel.
--fault sleep: rank 1 sleeps 120 s in the user's code before a backward.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import paratrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["ddp", "parallel"], default="ddp")
    parser.add_argument("--fault", choices=["sleep"], default="sleep")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    if args.api == "ddp":
        dist.init_process_group("gloo")
        model = paratrain.DistributedDataParallel(net, timeout=args.timeout)
        rank = dist.get_rank()
    else:
        par = paratrain.Parallel("ddp", timeout=args.timeout)
        model, rank = par.prepare(net), par.rank
    x = torch.randn(8, 4)
    for step in range(3):
        loss = model(x).sum()
        if rank == 1 and step == 1:
            time.sleep(120)  # the user's line where rank 1 stalls
        loss.backward()
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
