"""A user's own minimal DDP script: gloo, paratrain's DistributedDataParallel, 5 SGD steps; how it ends varies.

    python -m torch.distributed.run --standalone --nproc-per-node 3 scripts/exit_probe.py [--ending ENDING]

--ending destroy (default): destroy_process_group() with the wrapper still alive (a plain script);
         no-destroy: the script just ends; del-then-destroy: the wrapper is deleted, then the group destroyed.
scripts/stress_exit.py runs it many times and counts the runs that did not exit 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import paratrain

parser = argparse.ArgumentParser()
parser.add_argument("--ending", choices=["destroy", "no-destroy", "del-then-destroy"], default="destroy")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = paratrain.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if args.ending == "del-then-destroy":
    del model, optimizer
if args.ending != "no-destroy":
    dist.destroy_process_group()
