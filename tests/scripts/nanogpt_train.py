"""nanoGPT's train.py, its DDP path as it is, shrunk to the CPU: the client whose one-line swap we promise.

    torchrun --nproc-per-node 2 nanogpt_train.py --compile=True --out=result.json

What is nanoGPT's: rank from RANK/LOCAL_RANK/WORLD_SIZE, ``seed = 1337 + rank``, gradient accumulation steps divided
by the world size, ``torch.compile(model)`` before ``DDP(model)``, ``model.require_backward_grad_sync`` set on the
last micro-step only, the GradScaler (off unless float16), ``scaler.unscale_`` then ``clip_grad_norm_`` on
``model.parameters()``, warm-up and cosine learning rate, AdamW with weight-decay groups, ``raw_model =
model.module``. What is not: the model is tests/nanogpt_shaped.py's (the loss taken here), the data random
tokens, no evaluation or checkpoint, and ``compile_backend`` picks dynamo's backend (nanoGPT's is inductor).
The test swaps the import line below for paratrain's and compares the two runs' losses and weights.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanogpt_shaped import CONTEXT, VOCAB, NanoGPT

# -- config: nanoGPT's names; --key=value on the command line overrides (its configurator.py, in short) --------
batch_size = 4
block_size = CONTEXT
gradient_accumulation_steps = 4
max_iters = 6
learning_rate = 6e-4
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
warmup_iters = 2
lr_decay_iters = 6
min_lr = 6e-5
backend = "gloo"
device = "cpu"
dtype = "float32"
compile = True  # nanoGPT's name
compile_backend = "inductor"
out = "result.json"
for arg in sys.argv[1:]:
    key, value = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    current = globals()[key]
    globals()[key] = (value == "True") if isinstance(current, bool) else type(current)(value)

# -- nanoGPT's set-up ------------------------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
torch.manual_seed(1337 + seed_offset)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (batch_size, block_size + 1))
    return data[:, :-1], data[:, 1:]


torch.manual_seed(1337)  # the same initial model everywhere (nanoGPT builds it before any rank draws data)
model = NanoGPT()
torch.manual_seed(1337 + seed_offset)
scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=learning_rate,
    betas=(beta1, beta2),
)
if compile:
    model = torch.compile(model, backend=compile_backend)
if ddp:
    model = DDP(model)


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- nanoGPT's loop --------------------------------------------------------------------------------------------
losses, norms = [], []
X, Y = get_batch()
raw_model = model.module if ddp else model
for iter_num in range(max_iters):
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with torch.autocast("cpu", dtype=ptdtype, enabled=dtype != "float32"):
            logits = model(X)
            loss = F.cross_entropy(logits.view(-1, VOCAB), Y.reshape(-1))
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item() * gradient_accumulation_steps)

state = raw_model.state_dict()
if master_process:
    with open(out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "norms": norms,
                "keys": sorted(state),
                "weights": torch.cat([state[k].reshape(-1).float() for k in sorted(state)]).tolist(),
                "ddp": f"{type(model).__module__}.{type(model).__name__}",
            },
            f,
        )
if ddp:
    destroy_process_group()
