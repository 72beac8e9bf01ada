"""What each rank runs in the tests of zero3 (tests/test_zero3.py); every function returns JSON-able findings.

The oracle is our DDP in the same processes, on the same model, data and optimizer: the whole state dict after
every step (and the outputs of an evaluation under torch.no_grad()) compared bit for bit; one device on the whole
batches within rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.checkpoint.sharded import is_sharded_checkpoint
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.sharded.guard import ShardedGradient
from paratrain.strategies import Zero3Strategy
from zero_scenarios import model as mlp
from zero_scenarios import optimizer_for, torch_utilities

GLOBAL_BATCH = 24
STEPS = 3
VOCAB, WIDTH, CONTEXT = 96, 64, 8


class Block(nn.Module):
    """A transformer block's MLP half: pre-norm, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    """nanoGPT's shape: token and (frozen) position embeddings, blocks, a final norm, the head tied to wte."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(CONTEXT, WIDTH),
                "h": nn.ModuleList([Block() for _ in range(3)]),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them
        self.transformer.wpe.weight.requires_grad_(False)  # a frozen layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.transformer.ln_f(x))
        return logits


class Joined(nn.Module):
    """A unit of two large weights whose gradients autograd gives as views of one buffer (cat's backward) and as a
    transposed view (cloned by AccumulateGrad), a frozen bias and a small trainable one: 180979 elements, padded at
    2 and 3 ranks, the second weight split between ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.left_weight = nn.Parameter(torch.randn(300, 301) * 0.05)
        self.right_weight = nn.Parameter(torch.randn(301, 300) * 0.05)
        self.bias = nn.Parameter(torch.full((301,), 0.1), requires_grad=False)
        self.shift_bias = nn.Parameter(torch.randn(78) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ torch.cat([self.left_weight, self.right_weight.t()]) + self.bias
        return torch.cat([h[:, :78] + self.shift_bias, h[:, 78:]], dim=1)


def joined_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 600), nn.Tanh(), Joined(), nn.Tanh(), nn.Linear(301, 10))


def bn_net() -> nn.Module:
    """BatchNorm (its running statistics are buffers), a frozen layer in a unit of its own."""
    net = nn.Sequential(
        nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    net[3].requires_grad_(False)
    return net


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return mlp(seed)
    if name == "gpt":
        return TinyGPT()
    if name == "joined":
        return joined_net()
    return bn_net()


# the zero3 options of each model: the default policy (the MLP: two blocks, the root the rest), the user's list
# (the tied weights' modules in units of their own: the weight is then the root's), a small min_params
OPTIONS: dict[str, dict[str, Any]] = {
    "mlp": {},
    "gpt": {"units": [Block, "transformer.wte", "lm_head"]},
    "bn": {"min_params": 1000},
    "joined": {},
}


def batches(name: str, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        return [
            (
                torch.randint(0, VOCAB, (GLOBAL_BATCH, CONTEXT), generator=g),
                torch.randint(0, VOCAB, (GLOBAL_BATCH, CONTEXT), generator=g),
            )
            for _ in range(steps)
        ]
    return [
        (torch.randn(GLOBAL_BATCH, 64, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def parallel(strategy: str, model_name: str, precision: str = "32", **extra: Any) -> paratrain.Parallel:
    if strategy == "zero3":
        return paratrain.Parallel(Zero3Strategy("cpu", **{**OPTIONS[model_name], **extra}), precision=precision)
    # the zero3 options in extra are zero3's alone; ddp takes a bucket size
    return paratrain.Parallel(strategy, "cpu", precision=precision, bucket_cap_mb=extra.get("bucket_cap_mb"))


def state_of(par: paratrain.Parallel, net: nn.Module) -> dict[str, torch.Tensor]:
    """The prepared model's state dict: whole tensors under every strategy (zero3 gathers them)."""
    return {k: v.detach().clone() for k, v in par.unwrap(net).state_dict().items()}


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.double().reshape(-1) for v in state.values()])


def train(
    strategy: str,
    model_name: str = "mlp",
    *,
    optimizer: str = "sgd",
    precision: str = "32",
    accumulate: int = 1,
    clip: float | None = None,
    steps: int = STEPS,
    backwards: int = 1,
    forward_before_step: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Train under ``strategy``: the state after every step, an evaluation's outputs, the clipping norms."""
    with parallel(strategy, model_name, precision, **extra) as par:
        net = build(model_name)
        opt = optimizer_for(optimizer, net)
        net, opt, loader = par.prepare(net, opt, batches(model_name, steps))
        after, outputs, norms = [], [], []
        probe = batches(model_name, 1, seed=7)[0][0]
        for x, y in loader:
            for _ in range(backwards):  # more than one: two backwards before one step add up
                for xm, ym in par.accumulate(net, (x, y), steps=accumulate):
                    par.backward(loss_of(net(xm), ym))
            if clip is not None:
                norms.append(float(par.clip_grad_norm_(net, clip)))
            if forward_before_step:  # a forward with autograd on and no backward (a loss logged without no_grad)
                net(probe)
            par.step(opt)
            opt.zero_grad()
            after.append(state_of(par, net))
            net.eval()
            with torch.no_grad():
                outputs.append(net(probe).float().clone())
            net.train()
        keys = list(par.unwrap(net).state_dict())
        return {"after": after, "outputs": outputs, "norms": norms, "keys": keys}


CONFIGS: dict[str, dict[str, Any]] = {
    "mlp, sgd momentum": {"model_name": "mlp", "optimizer": "sgd"},
    "mlp, adamw": {"model_name": "mlp", "optimizer": "adamw"},
    "mlp, sgd momentum, accumulate 2, clip": {"model_name": "mlp", "optimizer": "sgd", "accumulate": 2, "clip": 0.05},
    "mlp, adamw, accumulate 3, clip": {"model_name": "mlp", "optimizer": "adamw", "accumulate": 3, "clip": 0.5},
    "mlp, sgd, no prefetch, kept after forward": {
        "model_name": "mlp",
        "optimizer": "sgd",
        "zero3": {"prefetch": 0, "reshard_after_forward": False},
    },
    "mlp, sgd, prefetch 2": {"model_name": "mlp", "optimizer": "sgd", "zero3": {"prefetch": 2}},
    # the units kept gathered after that forward (the root, the last) are released by the step: not stale next time
    "mlp, adamw, a forward without backward before each step": {
        "model_name": "mlp",
        "optimizer": "adamw",
        "forward_before_step": True,
    },
    "gpt tied + frozen, adamw, accumulate 2, clip": {
        "model_name": "gpt",
        "optimizer": "adamw",
        "accumulate": 2,
        "clip": 1.0,
    },
    "gpt tied + frozen, sgd momentum": {"model_name": "gpt", "optimizer": "sgd"},
    "batchnorm + frozen, sgd momentum, clip": {"model_name": "bn", "optimizer": "sgd", "clip": 0.1},
    "mlp, adamw, bf16-mixed": {"model_name": "mlp", "optimizer": "adamw", "precision": "bf16-mixed"},
    "mlp, adamw, 16-mixed, clip": {"model_name": "mlp", "optimizer": "adamw", "precision": "16-mixed", "clip": 1.0},
}


# a bucket per parameter or two (the models' parameters are 1-100 KB): gloo's all-reduce then adds each element's
# three terms in another order than with ddp's default 25 MB buckets, as zero3's unit buffers make it do
OTHER_BUCKET_CAP_MB = 0.05


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compare(runs: dict[str, dict[str, Any]], oracle: str, other: str) -> dict[str, Any]:
    a, b = runs[other], runs[oracle]
    pairs = list(zip(a["after"], b["after"], strict=True))
    return {
        "keys": a["keys"] == b["keys"],
        "bitwise": all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in pairs),
        "rel": max(_relative(flat(x), flat(y)) for x, y in pairs),
        "outputs_bitwise": all(torch.equal(x, y) for x, y in zip(a["outputs"], b["outputs"], strict=True)),
        "norms": a["norms"] == b["norms"],
        "finite": all(bool(torch.isfinite(flat(x)).all()) for x, _ in pairs),
    }


def exactness(rank: int, world: int, names: tuple[str, ...] = tuple(CONFIGS)) -> dict[str, Any]:
    """Each configuration under ddp and zero3 (and one device): the states after every step, the evaluations."""
    found = {}
    for name in names:
        config = dict(CONFIGS[name])
        zero3 = config.pop("zero3", {})
        runs = {"ddp": train("ddp", **config), "zero3": train("zero3", **config, **zero3)}
        entry = compare(runs, "ddp", "zero3")
        if world > 2:  # ddp against itself with other buckets: the same sums in another order, its own spread
            runs["ddp, other buckets"] = train("ddp", **config, bucket_cap_mb=OTHER_BUCKET_CAP_MB)
            entry["ddp_spread"] = compare(runs, "ddp", "ddp, other buckets")["rel"]
        initial = flat(state_of_plain(config["model_name"]))
        entry["moved"] = _relative(flat(runs["ddp"]["after"][-1]), initial)
        entry["user_keys"] = runs["zero3"]["keys"] == list(build(config["model_name"]).state_dict())
        found[name] = entry
    return found


def state_of_plain(model_name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build(model_name).state_dict().items()}


def two_backwards(rank: int, world: int) -> dict[str, Any]:
    """Two synchronised backwards before one step add up, as .grad does under ddp; also with a no_sync backward
    after a synchronised one (accumulating into the reduced gradient)."""
    runs = {s: train(s, "mlp", optimizer="sgd", backwards=2) for s in ("ddp", "zero3")}
    once = train("ddp", "mlp", optimizer="sgd")
    found = compare(runs, "ddp", "zero3")
    found["differs_from_one_backward"] = not torch.equal(flat(once["after"][-1]), flat(runs["ddp"]["after"][-1]))
    mixed = {s: train(s, "mlp", optimizer="adamw", backwards=2, accumulate=2) for s in ("ddp", "zero3")}
    found["with_no_sync"] = compare(mixed, "ddp", "zero3")
    return found


def gradients(rank: int, world: int) -> dict[str, Any]:
    """One backward's reduced gradients under zero3 (gathered from the shards) against ddp's."""
    grads = {}
    for strategy in ("ddp", "zero3"):
        with parallel(strategy, "mlp") as par:
            net = build("mlp")
            net, _, loader = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), batches("mlp", 1))
            for x, y in loader:
                par.backward(loss_of(net(x), y))
            grads[strategy] = torch.cat([g.reshape(-1) for g in par.gradients(net)])
    return {
        "bitwise": torch.equal(grads["zero3"], grads["ddp"]),
        "rel": _relative(grads["zero3"], grads["ddp"]),
        "moved": bool(grads["ddp"].abs().max() > 0),
    }


def backwards_against_ddp(rank: int, world: int) -> dict[str, Any]:
    """Each unit's gradients copied into its flat gradient and reduce-scattered: training against ddp on the MLP
    and on a model whose gradients are views of one tensor (cat's), a transposed view and a frozen bias, also with
    accumulation (no_sync, then a whole kept gradient) and clipping."""
    found: dict[str, Any] = {}
    for name in ("mlp", "joined"):
        runs = {s: train(s, name, optimizer="sgd") for s in ("ddp", "zero3")}
        found[name] = compare(runs, "ddp", "zero3")
        runs = {s: train(s, name, optimizer="adamw", accumulate=2, clip=0.5) for s in ("ddp", "zero3")}
        found[f"{name}, accumulate 2, clip"] = compare(runs, "ddp", "zero3")
    return found


def memory_and_layout(rank: int, world: int) -> dict[str, Any]:
    """What a rank holds: its shards only between steps, parameters reading NaN, gradients as shard parts."""
    with parallel("zero3", "mlp") as par:
        net = build("mlp")
        net, opt, loader = par.prepare(net, optimizer_for("adamw", net), batches("mlp", 1))
        assert isinstance(net, FullyShardedDataParallel)
        x, y = next(iter(loader))
        par.backward(loss_of(net(x), y))
        found: dict[str, Any] = {
            "units": [u.name for u in net.units],
            "unit_params": [len(u.params) for u in net.units],
            "gathered_after_backward": [u.gathered for u in net.units],
            "storage_after_backward": [u.full.untyped_storage().nbytes() for u in net.units],
            "grad_parts": [u.shard_grad.numel() if u.shard_grad is not None else None for u in net.units],
            "parts": [u.part for u in net.units],
            "whole_grads_gone": all(
                isinstance(p.grad, ShardedGradient) and u.grad_full is None for u in net.units for p in u.params
            ),
        }
        par.step(opt)
        found["shard_numel"] = sum(u.shard.numel() for u in net.units)
        found["model_numel"] = sum(p.numel() for p in build("mlp").parameters())
        found["params_keep_shape"] = [tuple(p.shape) for p in par.unwrap(net).parameters()] == [
            tuple(p.shape) for p in build("mlp").parameters()
        ]
        refused = []
        for p in par.unwrap(net).parameters():  # between uses: any read of a value is refused, naming the fix
            try:
                p.detach().clone()
                refused.append("read")
            except paratrain.ConfigError as exc:
                refused.append("par.full_weights(model)" in str(exc))
        found["params_refuse_reads"] = all(r is True for r in refused)
        held = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
        found["optimizer_state"] = held
        first = dict(net.prefetched)  # the first forward learns the order: only its backward prefetches
        par.backward(loss_of(net(x), y))
        found["prefetched"] = [first, dict(net.prefetched)]
        grads = par.gradients(net)
        found["gradients_whole"] = all(g is not None for g in grads)
    return found


def checkpoints(rank: int, world: int, directory: str, others: bool = True) -> dict[str, Any]:
    """A zero3 checkpoint (every rank its slices) resumed under zero3, ddp and single; ddp and zero2 checkpoints
    resumed under zero3 (``others``): each continuing exactly as the run that never stopped."""
    found: dict[str, Any] = {}
    data = batches("gpt", 4)
    Path(directory).mkdir(parents=True, exist_ok=True)

    def run(strategy: str, steps: range, load: Path | None, save: Path | None) -> torch.Tensor:
        with parallel(strategy, "gpt") as par:
            net = build("gpt")
            net, opt = par.prepare(net, optimizer_for("adamw", net))
            if load is not None:
                rest = par.load(load, into={"model": net, "optimizer": opt})
                found[f"{strategy}_step"] = rest["step"]
            for i, (x, y) in enumerate(par.prepare(data)):
                if i in steps:
                    par.backward(loss_of(net(x), y))
                    opt.step()
                    opt.zero_grad()
            if save is not None:
                save.parent.mkdir(parents=True, exist_ok=True)
                written = par.save({"model": net, "optimizer": opt, "step": 2}, save)
                found[f"{strategy}_written"] = str(written) if written is not None else None
            return flat(state_of(par, net))

    sharded = Path(directory) / f"zero3-{world}" / "step-2.pt"
    sharded.parent.mkdir(parents=True, exist_ok=True)
    saved = run("zero3", range(2), load=None, save=sharded)
    if rank == 0:  # what the checkpoint holds, whole: the oracle of a resume at another world size
        torch.save(saved, sharded.parent / "state.pt")
    found["files"] = sorted(f.name for f in sharded.iterdir())
    found["sharded"] = is_sharded_checkpoint(sharded)
    uninterrupted = run("zero3", range(4), load=None, save=None)
    for strategy in ("zero3", "ddp", "single") if others else ("zero3", "single"):
        resumed = run(strategy, range(2, 4), load=sharded, save=None)
        found[f"{strategy}_bitwise"] = torch.equal(resumed, uninterrupted)
        found[f"{strategy}_rel"] = _relative(resumed, uninterrupted)
    for source in ("ddp", "zero2") if others else ():
        path = Path(directory) / f"{source}-{world}" / "step-2.pt"
        run(source, range(2), load=None, save=path)
        resumed = run("zero3", range(2, 4), load=path, save=None)
        found[f"from_{source}_bitwise"] = torch.equal(resumed, uninterrupted)
        found[f"from_{source}_rel"] = _relative(resumed, uninterrupted)
    return found


def resume_elsewhere(rank: int, world: int, directory: str) -> dict[str, Any]:
    """The checkpoint another world size's zero3 wrote, resumed here under zero3 and ddp: the model as it was
    saved, bit for bit, and the two continuing alike (bit for bit at two ranks)."""
    found: dict[str, Any] = {}
    written = [p for p in Path(directory).glob("zero3-*/step-2.pt") if p.parent.name != f"zero3-{world}"]
    assert written, f"no zero3 checkpoint of another world size under {directory}"
    saved = torch.load(written[0].parent / "state.pt", weights_only=True)
    data = batches("gpt", 4)
    resumed = {}
    for strategy in ("zero3", "ddp"):
        with parallel(strategy, "gpt") as par:
            net = build("gpt")
            net, opt = par.prepare(net, optimizer_for("adamw", net))
            par.load(written[0], into={"model": net, "optimizer": opt})
            found[f"{strategy}_loaded_bitwise"] = torch.equal(flat(state_of(par, net)), saved)
            for i, (x, y) in enumerate(par.prepare(data)):
                if i >= 2:
                    par.backward(loss_of(net(x), y))
                    opt.step()
                    opt.zero_grad()
            resumed[strategy] = flat(state_of(par, net))
    found["from"] = written[0].parent.name
    found["zero3_is_ddp_bitwise"] = torch.equal(resumed["zero3"], resumed["ddp"])
    found["zero3_ddp_rel"] = _relative(resumed["zero3"], resumed["ddp"])
    return found


def meta_init(rank: int, world: int) -> dict[str, Any]:
    """A model built on the meta device: the weights a plain build with the same seed gives; it trains as ddp."""
    found: dict[str, Any] = {}
    for name in ("mlp", "gpt", "bn"):
        plain = state_of_plain(name)
        with parallel("zero3", name) as par:
            torch.manual_seed(0)
            with torch.device("meta"):
                net = TinyGPT() if name == "gpt" else bn_net() if name == "bn" else _meta_mlp()
            opt = optimizer_for("sgd", net)  # over the meta parameters: prepare points it at the new ones
            net, opt = par.prepare(net, opt)
            state = state_of(par, net)
            found[f"{name}_equal"] = state.keys() == plain.keys() and all(
                torch.equal(state[k], plain[k]) for k in plain
            )
            found[f"{name}_tied"] = (
                name != "gpt" or par.unwrap(net).lm_head.weight is par.unwrap(net).transformer.wte.weight
            )
            for x, y in par.prepare(batches(name, 2)):
                par.backward(loss_of(net(x), y))
                opt.step()
                opt.zero_grad()
            meta_after = state_of(par, net)
        ddp_after = train("ddp", name, optimizer="sgd", steps=2)["after"][-1]
        found[f"{name}_trains_as_ddp"] = all(torch.equal(meta_after[k], ddp_after[k]) for k in ddp_after)
    found |= _recorded_nanogpt()
    return found


def _recorded_nanogpt() -> dict[str, Any]:
    """nanoGPT built inside ``par.init_module()`` (its own LayerNorm, ``apply(init)``, scaled c_proj, tied head):
    under zero3 on the meta device and replayed, under ddp as written; both train alike from a plain build's
    weights, and the script's next draw after building is the plain build's."""
    from nanogpt_shaped import Block as NanoBlock
    from nanogpt_shaped import NanoGPT

    torch.manual_seed(0)
    plain = {k: v.detach().clone() for k, v in NanoGPT().state_dict().items()}
    plain_next = torch.randn(4)
    found: dict[str, Any] = {}
    after = {}
    for strategy in ("zero3", "ddp"):
        with parallel(strategy, "gpt", units=[NanoBlock]) as par:
            torch.manual_seed(0)
            with par.init_module():
                net = NanoGPT()
            found[f"nanogpt_{strategy}_next_draw"] = torch.equal(torch.randn(4), plain_next)
            found[f"nanogpt_{strategy}_on_meta"] = all(p.is_meta for p in net.parameters())
            opt = optimizer_for("sgd", net)
            net, opt = par.prepare(net, opt)
            state = state_of(par, net)
            found[f"nanogpt_{strategy}_equal"] = state.keys() == plain.keys() and all(
                torch.equal(state[k], plain[k]) for k in plain
            )
            for x, y in par.prepare(batches("gpt", 2)):
                par.backward(loss_of(net(x), y))
                opt.step()
                opt.zero_grad()
            after[strategy] = state_of(par, net)
    found["nanogpt_trains_as_ddp"] = all(torch.equal(after["zero3"][k], after["ddp"][k]) for k in after["ddp"])
    return found


def _meta_mlp() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(64, 512), nn.Tanh()]
    layers += [nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def two_ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every scenario, in one set of processes (start-up is slow); the three ranks' checkpoint resumed here."""
    return {
        "exactness": exactness(rank, world),
        "two_backwards": two_backwards(rank, world),
        "gradients": gradients(rank, world),
        "memory": memory_and_layout(rank, world),
        "backwards": backwards_against_ddp(rank, world),
        "checkpoints": checkpoints(rank, world, directory),
        "resume_elsewhere": resume_elsewhere(rank, world, directory),
        "meta": meta_init(rank, world),
        "torch_utilities": torch_utilities(rank, world, "zero3"),
    }


THREE_RANK_CONFIGS = ("mlp, adamw", "mlp, sgd momentum, accumulate 2, clip", "gpt tied + frozen, sgd momentum")


def three_ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Two configurations against ddp, and the checkpoint that two ranks resume."""
    return {
        "exactness": exactness(rank, world, THREE_RANK_CONFIGS),
        "gradients": gradients(rank, world),
        "checkpoints": checkpoints(rank, world, directory, others=False),
    }
