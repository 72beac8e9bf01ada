"""A user's script in which rank 0 runs a training forward (autograd on) that rank 1 does not, under zero3.

    paratrain launch --nproc-per-node 2 user_zero3_forward.py --where before --timeout 120

--where before   rank 0 runs an extra forward before the step's own (a loss looked at without torch.no_grad())
--where inside   rank 0 runs an extra forward between the step's forward and its backward
--where eval     rank 0 evaluates under torch.no_grad() before the step's forward, rank 1 does not
--where none     no extra forward: every rank runs the same forwards (and, every step, one without a backward)
"""

from __future__ import annotations

import argparse

import torch

import paratrain
from paratrain.strategies import Zero3Strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=["before", "inside", "eval", "none"], default="before")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    par = paratrain.Parallel(Zero3Strategy(units=[torch.nn.Linear], timeout=args.timeout))
    # three units of the same size: gloo would pair one unit's all-gather with another's without a word
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    model, optimizer = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(8, 16)
    for step in range(args.steps):
        if args.where == "before" and step == 1 and par.is_main:
            model(x)  # the training forward only rank 0 runs
        if args.where == "eval" and step == 1 and par.is_main:
            with torch.no_grad():
                model(x)  # the evaluation only rank 0 runs
        loss = model(x).sum()
        if args.where == "inside" and step == 1 and par.is_main:
            model(x)  # the extra forward only rank 0 runs, before the step's backward
        if args.where == "none":
            model(x)  # every rank: a forward whose backward never comes
        par.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {par.rank} finished", flush=True)


if __name__ == "__main__":
    main()
