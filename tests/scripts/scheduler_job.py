"""One rank of a small ddp job through paratrain.Parallel, started by whatever the test imitates (torchrun, srun,
a PyTorchJob pod, mpirun): rank 0 writes where each rank sat and the trained weights to the file given."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain

out = sys.argv[1]
with paratrain.Parallel("ddp", "cpu", timeout=60) as par:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    model, optimizer, loader = par.prepare(model, optimizer, batches)
    for x, y in loader:
        par.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    env = par.environment
    places: list[object] = [None] * par.world_size
    dist.all_gather_object(places, [env.scheduler, env.rank, env.local_rank, env.world_size, env.node_rank])
    if par.is_main:
        state = par.unwrap(model).state_dict()
        weights = torch.cat([state[k].reshape(-1) for k in sorted(state)]).tolist()
        with open(out, "w") as f:
            json.dump({"places": places, "weights": weights}, f)
