"""A user's script in which one rank stalls (issue: the whole job must still end soon after the timeout).

    torchrun --nproc-per-node 2 user_hang.py --api ddp --fault sleep --timeout 3

--api ddp: paratrain.DistributedDataParallel over the user's own init_process_group; --api parallel: Parallel.
--fault: what rank 1 does at its second step, before the backward (rank 0 goes on):
  sleep     sleeps 120 s in the user's code
  stop      stops its own process (SIGSTOP)
  loop      loops in Python for ever
  native    loops for ever in native code that holds the GIL: it cannot answer, only faulthandler's signal shows it
  kill      ends its process at once (exit code 3)
  only0     (rank 0 does it) an all-reduce of the user's own that only rank 0 makes
  shapes    both ranks all-reduce a tensor of the user's, of different sizes
  slow      (no fault) rank 1 takes 50 ms longer every step: the others wait for it
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import time

import torch
import torch.distributed as dist

import paratrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["ddp", "parallel"], default="ddp")
    parser.add_argument("--strategy", default="ddp", help="Parallel's strategy (--api parallel)")
    parser.add_argument(
        "--fault", choices=["sleep", "stop", "loop", "native", "kill", "only0", "shapes", "slow"], default="sleep"
    )
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=60, help="steps of 50 ms each, the fault at the second")
    args = parser.parse_args()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    if args.api == "ddp":
        dist.init_process_group("gloo")
        model = paratrain.DistributedDataParallel(net, timeout=args.timeout)
        rank = dist.get_rank()
    else:
        par = paratrain.Parallel(args.strategy, timeout=args.timeout)
        model, rank = par.prepare(net), par.rank
    x = torch.randn(8, 4)
    for step in range(args.steps):
        time.sleep(0.1 if args.fault == "slow" and rank == 1 else 0.05)  # a step's worth of work
        loss = model(x).sum()
        if step == 1:
            print(f"rank {rank} at fault {time.time():.3f}", flush=True)  # the clock starts here, not at start-up
            fault(args.fault, rank)
        if args.api == "ddp":
            loss.backward()  # the raw wrapper keeps torch's contract
        else:
            par.backward(loss)
    waited = model.monitor.waited if args.api == "ddp" else par.collective_wait_seconds
    print(f"rank {rank} finished, waited {waited:.3f} s in collectives", flush=True)


def fault(kind: str, rank: int) -> None:
    if kind == "only0" and rank == 0:
        dist.all_reduce(torch.ones(10))  # the user's collective that only rank 0 reaches (a bucket's size: 10)
    if kind == "shapes":
        dist.all_reduce(torch.ones(4 if rank == 0 else 8))  # the user's collective, of a different size per rank
    if rank != 1:
        return
    if kind == "sleep":
        time.sleep(120)  # the user's line where rank 1 stalls
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 stops itself
    elif kind == "loop":
        while True:  # rank 1 loops for ever
            pass
    elif kind == "native":
        sum(itertools.count())  # rank 1 adds for ever in C, never letting another thread run
    elif kind == "kill":
        os._exit(3)  # rank 1 is gone


if __name__ == "__main__":
    main()
