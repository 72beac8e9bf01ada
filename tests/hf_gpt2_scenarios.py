"""What each rank runs in tests/test_zero3_hf.py: a Hugging Face GPT-2 built from a config, under our ddp and zero3.

The oracle is our DDP in the same processes, on the same model, data and optimizer: the whole state dict after
every step (zero3's gathered by its ``state_dict()``) and the logits of an evaluation under torch.no_grad(),
compared bit for bit. The loss is the model's own (``model(input_ids, labels=labels).loss``, a ModelOutput).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import paratrain
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.strategies import Zero3Strategy

VOCAB, CONTEXT, GLOBAL_BATCH, STEPS = 128, 16, 8, 3


def gpt2() -> nn.Module:
    """Two blocks of width 64 (about 50k parameters each), no dropout; ``lm_head.weight is transformer.wte.weight``."""
    from transformers import GPT2Config, GPT2LMHeadModel  # here: collecting the tests (make unit) imports none of it

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,  # in the vocabulary (GPT-2's 50256 is not)
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def build() -> nn.Module:
    torch.manual_seed(0)
    return gpt2()


# the zero3 units: at this width every block is below the default policy's 65536 parameters, so the root is the one
# unit; each GPT2Block a unit; GPT2Model a unit with its blocks inside it, the tied weight then the root's (lm_head
# there, wte inside the transformer unit: gathered with the root, used by both)
LAYOUTS = ("default units", "GPT2Block units", "GPT2Model and GPT2Block units")


def options_of(name: str) -> dict[str, Any]:
    """The Zero3Strategy options of one of :data:`LAYOUTS`."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model

    options: dict[str, dict[str, Any]] = {
        "default units": {},
        "GPT2Block units": {"units": [GPT2Block]},
        "GPT2Model and GPT2Block units": {"units": [GPT2Model, GPT2Block]},
    }
    return options[name]


def param_groups(net: nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's two groups: matrices and embeddings decay, biases and LayerNorm weights do not (for GPT-2 the
    split Hugging Face's Trainer makes by name: no "bias", nothing in a LayerNorm)."""
    params = dict(net.named_parameters())  # the tied weight once
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def trainer_split(net: nn.Module) -> set[str]:
    """The parameter names Hugging Face's Trainer gives weight decay: none of a LayerNorm's, no "bias"."""
    in_norms = {id(p) for m in net.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return {n for n, p in net.named_parameters() if id(p) not in in_norms and "bias" not in n}


def optimizer_for(name: str, net: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(param_groups(net), lr=3e-3)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and their labels (the model shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, CONTEXT), generator=g)
        out.append((ids, ids.clone()))
    return out


def parallel(strategy: str, precision: str, options: dict[str, Any]) -> paratrain.Parallel:
    if strategy == "zero3":
        return paratrain.Parallel(Zero3Strategy("cpu", **options), precision=precision)
    return paratrain.Parallel(strategy, "cpu", precision=precision)


def state_of(par: paratrain.Parallel, net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in par.unwrap(net).state_dict().items()}


def train(
    strategy: str,
    *,
    optimizer: str = "adamw",
    precision: str = "32",
    accumulate: int = 1,
    clip: float | None = None,
    options: dict[str, Any] | None = None,
    init_module: bool = False,
) -> dict[str, Any]:
    """STEPS steps under ``strategy``: the state before and after every step, an evaluation's logits after each."""
    with parallel(strategy, precision, options or {}) as par:
        if init_module:  # zero3 records the construction on the meta device and replays it in prepare
            torch.manual_seed(0)
            with par.init_module():
                net = gpt2()
            on_meta = all(p.is_meta for p in net.parameters())
        else:
            net, on_meta = build(), False
        next_draw = torch.randn(4)  # the script's next draw after building
        opt = optimizer_for(optimizer, net)
        net, opt, loader = par.prepare(net, opt, batches(STEPS))
        units = [u.name for u in net.units] if isinstance(net, FullyShardedDataParallel) else []
        states, logits, norms = [state_of(par, net)], [], []
        probe = batches(1, seed=7)[0][0]
        for ids, labels in loader:
            for ids_m, labels_m in par.accumulate(net, (ids, labels), steps=accumulate):
                par.backward(net(ids_m, labels=labels_m).loss)
            if clip is not None:
                norms.append(float(par.clip_grad_norm_(net, clip)))
            par.step(opt)
            opt.zero_grad()
            states.append(state_of(par, net))
            net.eval()
            with torch.no_grad():
                logits.append(net(probe).logits.float().clone())
            net.train()
        module = par.unwrap(net)
        return {
            "states": states,
            "logits": logits,
            "norms": norms,
            "units": units,
            "on_meta": on_meta,
            "next_draw": next_draw,
            "tied": module.lm_head.weight is module.transformer.wte.weight,
        }


CONFIGS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adamw, accumulate 2, clip": {"accumulate": 2, "clip": 0.5},
    "adamw, bf16-mixed": {"precision": "bf16-mixed"},
    "adamw, bf16-mixed, accumulate 2, clip": {"precision": "bf16-mixed", "accumulate": 2, "clip": 0.5},
    "sgd momentum, accumulate 2, clip": {"optimizer": "sgd", "accumulate": 2, "clip": 0.5},
}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _moved(run: dict[str, Any]) -> float:
    first, last = run["states"][0], run["states"][-1]
    return max(float((last[k] - first[k]).abs().max()) for k in first)


def compare(oracle: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    pairs = zip(other["states"], oracle["states"], strict=True)
    return {
        # the state after each step, the initial one first: equal or not, step by step
        "bitwise": [_same(a, b) for a, b in pairs],
        "logits_bitwise": [torch.equal(a, b) for a, b in zip(other["logits"], oracle["logits"], strict=True)],
        "norms": other["norms"] == oracle["norms"],  # par.clip_grad_norm_'s: the same float32 numbers
        "units": other["units"],
        "tied": other["tied"],
    }


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Every configuration under ddp and under zero3 in each layout; zero3 built inside ``par.init_module()``."""
    plain = build()
    found: dict[str, Any] = {
        "keys": list(plain.state_dict()),
        "groups_as_trainer": trainer_split(plain) == {n for n, p in plain.named_parameters() if p.dim() >= 2},
        "exactness": {},
    }
    for name, config in CONFIGS.items():
        ddp = train("ddp", **config)
        # clipping scaled the gradients (a norm above max_norm) at some step: the clipped configurations clip
        clipped = "clip" not in config or any(n > config["clip"] for n in ddp["norms"])
        entry: dict[str, Any] = {"moved": _moved(ddp), "clipped": clipped}
        for layout in LAYOUTS:
            entry[layout] = compare(ddp, train("zero3", options=options_of(layout), **config))
        found["exactness"][name] = entry
    torch.manual_seed(0)
    gpt2()
    plain_next = torch.randn(4)
    ddp = train("ddp")
    for layout in LAYOUTS[:2]:
        recorded = train("zero3", options=options_of(layout), init_module=True)
        found[f"init_module, {layout}"] = {
            **compare(ddp, recorded),
            "on_meta": recorded["on_meta"],
            "next_draw": torch.equal(recorded["next_draw"], plain_next),
        }
    return found
