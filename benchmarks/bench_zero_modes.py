"""The models and the modes bench_zero_speed.py times: each mode a model, its optimizer, a step and its parameters.

    net = build_model("gpt")                        # or "mlp"; the same weights in every process (seeded)
    mode = build_mode("zero3", "gpt", width=2048, depth=3)   # inside a gloo process group of two
    mode.step(x, y)                                  # zero_grad, forward, loss, backward, optimizer step
    mode.full_params()                               # every parameter whole, by name (a collective: every rank)

Modes: ``local`` (the plain model, no communication), torch's ``DistributedDataParallel`` (``torch-ddp``) and
``fully_shard`` (``fsdp2``: reshard after forward, ZeRO-3; ``fsdp2-noreshard``), and paratrain's ``ddp``,
``zero1``, ``zero2``, ``zero3`` and ``zero3-noreshard``. zero3 and fsdp2 cut the model into the same units: those
paratrain's default policy picks (:func:`paratrain.sharded.units.plan_units`), the root holding the rest: the
MLP's three large Linears (the last, 20k parameters, stays in the root), the GPT's blocks.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_ddp import mlp  # the 784-WIDTHxDEPTH-10 MLP bench_ddp times
from torch import nn
from torch.nn import functional as F

from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.sharded.optimizer import shard_optimizer
from paratrain.sharded.units import plan_units
from paratrain.sharded.zero import ZeroDataParallel

MODELS = ("mlp", "gpt")
MODES = ("local", "torch-ddp", "fsdp2", "fsdp2-noreshard", "ddp", "zero1", "zero2", "zero3", "zero3-noreshard")
LR = 1e-4


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab: int = 2048
    seq: int = 64


GPT = GPTConfig()


class SelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.n_head, e // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(e, 2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, e))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), SelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.c_fc, self.c_proj = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))  # type: ignore[no-any-return]


class Trunk(nn.Module):
    """nanoGPT's ``transformer``: token and position embeddings, the blocks, the final norm."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.wpe = nn.Embedding(c.seq, c.n_embd)
        self.h = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """nanoGPT's shape: pre-norm blocks between embeddings and a final norm, the head tied to wte."""

    def __init__(self, c: GPTConfig = GPT) -> None:
        super().__init__()
        self.transformer = Trunk(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them
        for name, p in self.named_parameters():  # nanoGPT's initialisation, its residual projections scaled down
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))  # type: ignore[no-any-return]


def build_model(model: str, width: int = 2048, depth: int = 3) -> nn.Module:
    """The benchmark's model, the same weights in every process."""
    if model == "mlp":
        return mlp(width, depth)  # seeds itself
    torch.manual_seed(0)
    return TinyGPT()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's flags, shared by the scripts that time these modes: --model, --width, --depth, --batch."""
    parser.add_argument("--model", choices=MODELS, default="mlp", help="the 10M MLP or a small GPT")
    parser.add_argument("--width", type=int, default=2048, help="the MLP's width")
    parser.add_argument("--depth", type=int, default=3, help="the MLP's hidden layers")
    parser.add_argument("--batch", type=int, help="samples per rank and step (default: MLP 32, GPT 8 of 64 tokens)")


def default_batch(model: str) -> int:
    return 32 if model == "mlp" else 8


def make_batch(model: str, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: its own samples (seeded by rank), the same in every mode."""
    g = torch.Generator().manual_seed(rank)
    if model == "mlp":
        return torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    tokens = torch.randint(0, GPT.vocab, (batch, GPT.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


@dataclass
class Mode:
    name: str
    model: nn.Module  # what a step calls
    net: nn.Module  # the user's module inside it
    optimizer: torch.optim.Optimizer
    full: Callable[[], dict[str, torch.Tensor]]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss_of(self.model(x), y).backward()
        self.optimizer.step()

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole value by name (fsdp2 and zero3 gather them: every rank calls this)."""
        names = [n for n, _ in self.net.named_parameters()]
        state = self.full()
        return {n: state[n].detach().clone() for n in names}


def _own_state(net: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: net.state_dict()  # zero3's hook on the user's module gathers every unit (a collective)


def _fsdp2_state(net: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def full() -> dict[str, torch.Tensor]:  # DTensors: each all-gathered whole (a collective)
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in net.state_dict().items()}

    return full


def unit_names(net: nn.Module) -> list[str]:
    """The modules paratrain's default policy makes units of, the root left out (it holds the rest)."""
    return [u.name for u in plan_units(net) if u.name]


COMPILED = "+compile"  # a mode's name with this suffix: the model torch.compile'd (inductor) before it is wrapped


def build_mode(name: str, model: str, width: int = 2048, depth: int = 3) -> Mode:
    """``name``'s model and fp32 AdamW, inside an initialised gloo group; raises what a mode that cannot run raises.

    ``NAME+compile``: the same mode with ``torch.compile(model)`` before it is wrapped (nanoGPT's order)."""
    base, compiled = name.removesuffix(COMPILED), name.endswith(COMPILED)
    net = build_model(model, width, depth)
    if base.startswith("fsdp2"):
        if compiled:
            raise ValueError("fsdp2 with a model compiled before fully_shard is not a mode here")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        reshard = base == "fsdp2"
        for unit in unit_names(net):
            fully_shard(net.get_submodule(unit), mesh=mesh, reshard_after_forward=reshard)
        fully_shard(net, mesh=mesh, reshard_after_forward=reshard)
        return Mode(name, net, net, torch.optim.AdamW(net.parameters(), lr=LR), _fsdp2_state(net))
    model_given: nn.Module = torch.compile(net) if compiled else net  # type: ignore[assignment]
    wrapped, opt = _wrap(base, model_given, net)
    return Mode(name, wrapped, net, opt, _own_state(net))


def _wrap(name: str, model: nn.Module, net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` (``net``, or torch's compiled wrapper around it) in mode ``name``'s wrapper, and its optimizer."""
    wrapped: nn.Module = model
    if name == "local":
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    elif name == "torch-ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    elif name == "ddp":
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
    elif name in ("zero1", "zero2"):
        zero = ZeroDataParallel(model, stage=int(name[-1]))
        wrapped, opt = zero, shard_optimizer(torch.optim.AdamW(net.parameters(), lr=LR), zero)
    elif name.startswith("zero3"):
        sharded = FullyShardedDataParallel(model, reshard_after_forward=name == "zero3")
        wrapped, opt = sharded, shard_optimizer(torch.optim.AdamW(net.parameters(), lr=LR), sharded)
    else:
        raise ValueError(f"unknown mode {name!r}; known: {', '.join(MODES)}")
    return wrapped, opt
