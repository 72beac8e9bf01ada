"""What each rank runs in the tests of zero1 and zero2 (tests/test_zero.py); every function returns JSON-able findings.

The oracle is our DDP in the same processes, on the same model, data and optimizer: parameters after every step
compared bit for bit, and one device on the whole batches within rounding.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import paratrain
from paratrain.checkpoint.file import load_checkpoint
from paratrain.checkpoint.sharded import is_sharded_checkpoint
from paratrain.comm.process_groups import group_sequence
from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.errors import CollectiveError, ConfigError
from paratrain.sharded.guard import ShardedGradient
from paratrain.sharded.optimizer import ShardedOptimizer, shard_optimizer
from paratrain.sharded.reducer import ReduceScatter
from paratrain.sharded.zero import ZeroDataParallel

GLOBAL_BATCH = 24
STEPS = 3


def model(seed: int = 0) -> nn.Module:
    """About 560k parameters: two buckets (the first small), every world size splits a parameter between ranks."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(64, 512), nn.Tanh()]
    layers += [nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, 64, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def optimizer_for(name: str, net: nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups with settings of their own (the biases without weight decay, another lr)."""
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    if name == "sgd":
        return torch.optim.SGD(
            [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.05}],
            lr=0.1,
            momentum=0.9,
            weight_decay=1e-3,
        )
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.1)


def flat_params(par: paratrain.Parallel, net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in par.unwrap(net).parameters()]).clone()


def train(
    strategy: str,
    *,
    optimizer: str,
    precision: str = "32",
    accumulate: int = 1,
    clip: float | None = None,
    schedule: bool = False,
    schedule_before_prepare: bool = False,
    steps: int = STEPS,
) -> dict[str, Any]:
    """Train under ``strategy``; the parameters after every step, the clipping norms, the shard's state size."""
    with paratrain.Parallel(strategy, "cpu", precision=precision) as par:
        net = model()
        opt = optimizer_for(optimizer, net)
        scheduler = None
        if schedule_before_prepare:  # the order of many scripts: the scheduler holds the user's optimizer
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        users = opt
        net, opt, loader = par.prepare(net, opt, batches(steps))
        assert opt is users, "prepare returned another optimizer than the user's"
        if schedule:
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        after, norms = [], []
        for x, y in loader:
            for xm, ym in par.accumulate(net, (x, y), steps=accumulate):
                par.backward(F.cross_entropy(net(xm), ym))
            if clip is not None:
                norms.append(float(par.clip_grad_norm_(net, clip)))
            par.step(opt)
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
            after.append(flat_params(par, net))
        state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        return {"after": after, "norms": norms, "state_numel": state, "lr": [g["lr"] for g in opt.param_groups]}


CONFIGS: dict[str, dict[str, Any]] = {
    "sgd momentum, fp32": {"optimizer": "sgd"},
    "adamw, fp32": {"optimizer": "adamw"},
    "sgd momentum, bf16-mixed": {"optimizer": "sgd", "precision": "bf16-mixed"},
    "adamw, bf16-mixed": {"optimizer": "adamw", "precision": "bf16-mixed"},
    "sgd momentum, accumulate 2, clip": {"optimizer": "sgd", "accumulate": 2, "clip": 0.05},
    "adamw, scheduler built before prepare": {"optimizer": "adamw", "schedule_before_prepare": True},
    "adamw, bf16-mixed, accumulate 3, clip, schedule": {
        "optimizer": "adamw",
        "precision": "bf16-mixed",
        "accumulate": 3,
        "clip": 0.5,
        "schedule": True,
    },
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _initial() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model().parameters()])


def exactness(rank: int, world: int, names: tuple[str, ...] = tuple(CONFIGS), single: bool = True) -> dict[str, Any]:
    """Each configuration under single, ddp, zero1 and zero2: bitwise equality with ddp, closeness to one device."""
    found = {}
    compared = ("zero1", "zero2", "single") if single else ("zero1", "zero2")
    for name in names:
        config = CONFIGS[name]
        runs = {strategy: train(strategy, **config) for strategy in ("ddp", *compared)}
        ddp = runs["ddp"]
        entry: dict[str, Any] = {"moved": _relative(ddp["after"][-1], _initial()), "ddp_state": ddp["state_numel"]}
        for strategy in compared:
            run = runs[strategy]
            pairs = list(zip(run["after"], ddp["after"], strict=True))
            entry[f"{strategy}_bitwise"] = all(torch.equal(a, b) for a, b in pairs)
            entry[f"{strategy}_rel"] = max(_relative(a, b) for a, b in pairs)
            entry[f"{strategy}_norms"] = run["norms"] == ddp["norms"]
            entry[f"{strategy}_state"] = run["state_numel"]
            entry[f"{strategy}_lr"] = run["lr"] == ddp["lr"]
        found[name] = entry
    return found


def accumulate_across_backwards(
    strategy: str,
    optimizer: str,
    set_to_none: bool,
    *,
    pattern: tuple[str, ...] = ("sync", "sync"),
    zero_grad_after_first_forward: bool = False,
    last_only: bool = False,
) -> dict[str, Any]:
    """A step after every ``pattern`` of backwards ("sync", or "local" inside no_sync): the gradients add up.

    ``zero_grad_after_first_forward``: clear the gradients between a step's first forward and its backward instead
    of after the step; ``last_only``: before every backward, so each step sees its last micro-batch only.
    """
    with paratrain.Parallel(strategy, "cpu") as par:
        net = model()
        opt = optimizer_for(optimizer, net)
        net, opt, loader = par.prepare(net, opt, batches(STEPS * len(pattern)))
        after, whole_grads_held, collectives = [], [], []
        started = group_sequence(dist.group.WORLD)
        for i, (x, y) in enumerate(loader):
            kind = pattern[i % len(pattern)]
            with par.no_sync(net) if kind == "local" else contextlib.nullcontext():
                loss = F.cross_entropy(net(x), y)
                if last_only or (zero_grad_after_first_forward and i % len(pattern) == 0):
                    opt.zero_grad(set_to_none=set_to_none)
                par.backward(loss)
            if i % len(pattern) == len(pattern) - 1:
                opt.step()
                if not zero_grad_after_first_forward:
                    opt.zero_grad(set_to_none=set_to_none)
                after.append(flat_params(par, net))
                whole_grads_held.append(
                    any(
                        p.grad is not None and not isinstance(p.grad, ShardedGradient)
                        for p in par.unwrap(net).parameters()
                    )
                )
                collectives.append(group_sequence(dist.group.WORLD) - started)
                started = group_sequence(dist.group.WORLD)
        return {"after": after, "whole_grads_held": whole_grads_held, "collectives": collectives}


def _against_ddp(entry: dict[str, Any], runs: dict[str, dict[str, Any]], prefix: str = "") -> None:
    for strategy, run in runs.items():
        if strategy != "ddp":
            pairs = list(zip(run["after"], runs["ddp"]["after"], strict=True))
            entry[f"{prefix}{strategy}_bitwise"] = all(torch.equal(a, b) for a, b in pairs)
            entry[f"{prefix}{strategy}_max_diff"] = max(float((a - b).abs().max()) for a, b in pairs)


def accumulation(rank: int, world: int) -> dict[str, Any]:
    """Several synchronised backwards per step, under ddp (the oracle: .grad adds up), zero1 and zero2."""
    found: dict[str, Any] = {}
    for optimizer in ("sgd", "adamw"):
        for set_to_none in (True, False):
            runs = {s: accumulate_across_backwards(s, optimizer, set_to_none) for s in ("ddp", "zero1", "zero2")}
            last_only = accumulate_across_backwards("ddp", optimizer, set_to_none, last_only=True)
            entry: dict[str, Any] = {"adds_up": not torch.equal(runs["ddp"]["after"][-1], last_only["after"][-1])}
            _against_ddp(entry, runs)
            entry["zero2_whole_grads_held"] = runs["zero2"]["whole_grads_held"]
            entry["zero2_collectives"] = runs["zero2"]["collectives"]
            found[f"{optimizer}, zero_grad(set_to_none={set_to_none})"] = entry
    mixed = ("sync", "local", "sync")
    runs = {s: accumulate_across_backwards(s, "adamw", True, pattern=mixed) for s in ("ddp", "zero2")}
    entry = {}
    _against_ddp(entry, runs)
    found["adamw, a backward inside no_sync between two synchronised ones"] = entry
    runs = {
        s: accumulate_across_backwards(s, "adamw", True, zero_grad_after_first_forward=True) for s in ("ddp", "zero2")
    }
    entry = {"zero2_collectives": runs["zero2"]["collectives"]}
    _against_ddp(entry, runs)
    found["adamw, zero_grad between the first forward and its backward"] = entry
    return found


def optimizer_surface(rank: int, world: int) -> dict[str, Any]:
    """The prepared optimizer: the user's class and groups, this rank's state only, hooks once, what is refused."""
    found: dict[str, Any] = {}
    with paratrain.Parallel("zero2", "cpu") as par:
        net = model()
        user = optimizer_for("adamw", net)
        counts = {"pre": 0, "post": 0}
        net, opt = par.prepare(net, user)
        opt.register_step_pre_hook(lambda *a: counts.__setitem__("pre", counts["pre"] + 1))
        opt.register_step_post_hook(lambda *a: counts.__setitem__("post", counts["post"] + 1))
        found["same_class"] = isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "AdamW"
        found["sharded"] = isinstance(opt, ShardedOptimizer)
        found["groups_kept"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
            {k: v for k, v in g.items() if k != "params"} for g in user.param_groups
        ]
        for x, y in par.prepare(batches(2)):
            par.backward(F.cross_entropy(net(x), y))
            opt.step()
            opt.zero_grad()
        found["hooks_once_per_step"] = counts == {"pre": 2, "post": 2}
        mine = sum(p.numel() for g in opt.param_groups for p in g["params"])
        held = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
        total = par.all_reduce(torch.tensor(float(held)))
        found["state_is_the_shard"] = held == 2 * mine  # exp_avg and exp_avg_sq of this rank's pieces only
        found["states_cover_the_model"] = int(total) == 2 * sum(p.numel() for p in model().parameters())
        found["groups_per_rank"] = [len(g["params"]) for g in opt.param_groups]
        wrapper = net
        assert isinstance(wrapper, ZeroDataParallel)
        reducer = wrapper.reducer
        scatter = reducer.collective
        assert isinstance(scatter, ReduceScatter)
        found["no_whole_gradient"] = all(p.grad is None for p in par.unwrap(net).parameters())
        found["no_bucket_buffer"] = all(b.numel() == 0 for b in scatter.buffers)
        found["gradient_parts"] = sum(g.numel() for g in scatter.grads)
        found["bucket_elements"] = sum(b.numel for b in reducer.buckets)
        found["buckets"] = len(reducer.buckets)
        try:
            par.prepare(torch.optim.LBFGS(par.unwrap(net).parameters()))
        except ConfigError as exc:
            found["lbfgs"] = str(exc)
        try:
            par.prepare(torch.optim.SGD(model().parameters(), lr=0.1))
        except ConfigError as exc:
            found["foreign"] = str(exc)
    with paratrain.Parallel("zero1", "cpu") as par:
        net = par.prepare(model())
        opt = par.prepare(torch.optim.SGD(par.unwrap(net).parameters(), lr=0.1, momentum=0.9))
        x, y = batches(1)[0]
        par.backward(F.cross_entropy(net(x), y))
        buffers = {b.untyped_storage().data_ptr() for b in net.reducer.collective.buffers}
        found["zero1_grads_are_buckets"] = all(
            p.grad.untyped_storage().data_ptr() in buffers for p in par.unwrap(net).parameters()
        )
    return found


def gradients_and_overflow(rank: int, world: int) -> dict[str, Any]:
    """par.gradients under zero2 equals ddp's gradients; 16-mixed skips a step overflowing in one rank's shard only."""
    found: dict[str, Any] = {}
    grads = {}
    for strategy in ("ddp", "zero2"):
        with paratrain.Parallel(strategy, "cpu") as par:
            net = model()
            net, opt, loader = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), batches(1))
            for x, y in loader:
                par.backward(F.cross_entropy(net(x), y))
            grads[strategy] = torch.cat([g.reshape(-1) for g in par.gradients(net)])
    found["gradients_equal"] = torch.equal(grads["ddp"], grads["zero2"])
    for strategy in ("ddp", "zero2"):
        with paratrain.Parallel(strategy, "cpu", precision="16-mixed") as par:
            net = model()
            net, opt, loader = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), batches(2))
            first = par.unwrap(net)[0].weight
            # one element's gradient is inf on every rank: after the reduce-scatter only the rank owning it sees it
            handle = first.register_hook(
                lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), g.new_tensor(float("inf")))
            )
            before = flat_params(par, net)
            applied = []
            for step, (x, y) in enumerate(loader):
                par.backward(F.cross_entropy(net(x), y))
                applied.append(par.step(opt))
                opt.zero_grad()
                if step == 0:
                    handle.remove()
                    found[f"{strategy}_unchanged_after_skip"] = torch.equal(before, flat_params(par, net))
            found[f"{strategy}_applied"] = applied
            found[f"{strategy}_scale"] = float(par.precision.scaler.get_scale())
            found[f"{strategy}_after"] = flat_params(par, net).sum().item()
    return found


def _overflow_first_element(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def checkpoints(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A zero2 checkpoint written by every rank, loaded under zero1, ddp, single and zero2; and a ddp checkpoint (one
    file) loaded under zero1 and zero2: each continuing exactly as the run that never stopped."""
    found: dict[str, Any] = {}
    data = batches(4)
    Path(directory).mkdir(parents=True, exist_ok=True)
    sharded = Path(directory) / "epoch-0000-step-000002.pt"
    whole = Path(directory) / "ddp-step-2.pt"

    def run(strategy: str, steps: range, load: Path | None, save: Path | None) -> torch.Tensor:
        with paratrain.Parallel(strategy, "cpu") as par:
            net = model()
            net, opt = par.prepare(net, optimizer_for("adamw", net))
            if load is not None:
                rest = par.load(load, into={"optimizer": opt})
                par.unwrap(net).load_state_dict(rest["model"])
                found[f"{strategy}_step"] = rest["step"]
            for i, (x, y) in enumerate(par.prepare(data)):  # this rank's share of every global batch
                if i in steps:
                    par.backward(F.cross_entropy(net(x), y))
                    opt.step()
                    opt.zero_grad()
            if save is not None:
                save.parent.mkdir(parents=True, exist_ok=True)
                written = par.save({"model": net, "optimizer": opt, "step": 2}, save)
                found[f"{strategy}_written"] = str(written) if written is not None else None
            return flat_params(par, net)

    run("zero2", range(2), load=None, save=sharded)
    found["written"] = found.pop("zero2_written")
    found["sharded"] = is_sharded_checkpoint(sharded)
    found["files"] = sorted(f.name for f in sharded.iterdir())
    uninterrupted = run("zero2", range(4), load=None, save=None)
    for strategy in ("zero1", "ddp", "single", "zero2"):
        resumed = run(strategy, range(2, 4), load=sharded, save=None)
        found[f"{strategy}_bitwise"] = torch.equal(resumed, uninterrupted)
        found[f"{strategy}_rel"] = _relative(resumed, uninterrupted)
    run("ddp", range(2), load=None, save=whole)
    found["from_ddp_file"] = whole.is_file() and not is_sharded_checkpoint(whole)
    for strategy in ("zero1", "zero2"):  # the oracle: the run above that never stopped (zero at 2 ranks is ddp's)
        resumed = run(strategy, range(2, 4), load=whole, save=None)
        found[f"from_ddp_{strategy}_bitwise"] = torch.equal(resumed, uninterrupted)
    return found


class TiedModel(nn.Module):
    """A language model's shape: the output head shares the embedding's weight (one parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def tied_checkpoint(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A model with tied weights saved under zero2 and resumed under zero2 and ddp: the tied weight is one entry of
    the checkpoint under both its names, and the resumed runs end where the uninterrupted one does."""
    found: dict[str, Any] = {}
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 64, (GLOBAL_BATCH,), generator=g), torch.randint(0, 64, (GLOBAL_BATCH,), generator=g))]
    data *= 4
    path = Path(directory) / "tied" / "epoch-0000-step-000002.pt"
    path.parent.mkdir(parents=True, exist_ok=True)

    def run(strategy: str, steps: range, load: bool, save: bool) -> torch.Tensor:
        with paratrain.Parallel(strategy, "cpu") as par:
            net = TiedModel()
            net, opt = par.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
            if load:
                rest = par.load(path, into={"optimizer": opt})
                par.unwrap(net).load_state_dict(rest["model"])
            for i, (x, y) in enumerate(par.prepare(data)):
                if i in steps:
                    par.backward(F.cross_entropy(net(x), y))
                    opt.step()
                    opt.zero_grad()
            if save:
                par.save({"model": net, "optimizer": opt, "step": 2}, path)
            tied = par.unwrap(net).head.weight is par.unwrap(net).embed.weight
            return torch.cat([flat_params(par, net), torch.tensor([float(tied)])])

    run("zero2", range(2), load=False, save=True)
    index = load_checkpoint(path / "index.pt")
    found["model_entries"] = sorted(e["path"][1] for e in index["tensors"] if e["path"][0] == "model")
    found["aliases"] = {
        e["path"][1]: [a[1] for a in e.get("aliases", [])] for e in index["tensors"] if e["path"][0] == "model"
    }
    uninterrupted = run("zero2", range(4), load=False, save=False)
    for strategy in ("zero2", "ddp"):
        found[f"{strategy}_bitwise"] = torch.equal(run(strategy, range(2, 4), load=True, save=False), uninterrupted)
    return found


def a_rank_that_skips_the_step_is_named(rank: int, world: int) -> dict[str, Any] | str:
    """The last rank never steps: the others' step waits for its all-gathers, and fails in the first one, named,
    within the timeout."""
    with paratrain.Parallel("zero2", "cpu", timeout=2) as par:
        net = model()
        net, opt = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = batches(1)[0]
        par.backward(F.cross_entropy(net(x[:4]), y[:4]))
        if rank == world - 1:
            time.sleep(5)  # past the others' timeout and their report
            return "skipped"
        started = time.monotonic()
        try:
            opt.step()
            net(x[:4])
        except CollectiveError as exc:
            seconds = time.monotonic() - started
            # the first bucket's all-gather failed: reading every weight now (the user's error handling, a last log
            # line) neither waits for the rest to the timeout nor raises again
            read = "read"
            try:
                [p.detach().clone() for p in net.parameters()]
            except CollectiveError as again:
                read = f"raised again: {again}"
            return {"message": str(exc), "seconds": seconds, "left": bool(net._gathers), "read": read}
        return "no error"


def a_peer_that_dies_with_the_weights_in_flight(rank: int, world: int) -> dict[str, Any] | str:
    """Rank 1 ends after its backward, before its step: rank 0's step fails on the all-gather of the weights,
    named, at once rather than at the timeout; nothing is left in flight."""
    with paratrain.Parallel("zero1", "cpu", timeout=60) as par:
        net = model()
        net, opt = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = batches(1)[0]
        par.backward(F.cross_entropy(net(x[:4]), y[:4]))
        if rank == 1:
            os._exit(3)
        started = time.monotonic()
        try:
            opt.step()
            net(x[:4])
        except CollectiveError as exc:
            return {"message": str(exc), "seconds": time.monotonic() - started, "left": bool(net._gathers)}
        return "no error"


USER_GRADIENT_USES = (
    "torch clip_grad_norm_",
    "torch clip_grad_value_",
    "a hand-written norm",
    "an optimizer never prepared",
)


def torch_utilities(rank: int, world: int, strategy: str = "zero2") -> dict[str, Any]:
    """A user's own lines on gradients after par.backward: under zero2 (and zero3) each raises, naming the fix."""
    uses = {
        "torch clip_grad_norm_": lambda net, opt: torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0),
        "torch clip_grad_value_": lambda net, opt: torch.nn.utils.clip_grad_value_(net.parameters(), 0.1),
        "a hand-written norm": lambda net, opt: sum(p.grad.norm() ** 2 for p in net.parameters()),
        "an optimizer never prepared": lambda net, opt: opt.step(),
    }
    found: dict[str, Any] = {}
    for name, use in uses.items():
        with paratrain.Parallel(strategy, "cpu") as par:
            net = model()
            unprepared = torch.optim.SGD(net.parameters(), lr=0.1)
            net, opt, loader = par.prepare(net, optimizer_for("sgd", net), batches(1))
            x, y = next(iter(loader))
            par.backward(F.cross_entropy(net(x), y))
            try:
                use(par.unwrap(net), unprepared)
                found[name] = "no error"
            except ConfigError as exc:
                found[name] = str(exc)
            opt.zero_grad()
            par.backward(F.cross_entropy(net(x), y))  # after zero_grad() the next backward trains as before
            found[f"{name}: trains on"] = bool(float(par.clip_grad_norm_(net, 1.0)) > 0)
    return found


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _malloc_in_use() -> Any:
    """A reader of the bytes glibc's malloc has handed out and not had back (every arena, every thread), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallinfo2 = libc.mallinfo2  # glibc 2.33 on
    except (OSError, AttributeError, TypeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


class MallocHighWater(TorchDispatchMode):
    """The most bytes malloc had out, read after every torch op: torch's tensors and what gloo allocates inside a
    collective (its reduce-scatter's clone of the input), which no tracker of Python-visible tensors sees."""

    def __init__(self, in_use: Any) -> None:
        super().__init__()
        self.in_use = in_use
        self.peak = in_use()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def peak_memory(rank: int, world: int) -> dict[str, Any] | None:
    """Each strategy's high-water mark of malloc's bytes in use through STEPS AdamW steps, less what was in use
    before the model was built: many small buckets (a 1.6M-parameter MLP of 26 layers, 0.25 MB buckets)."""
    in_use = _malloc_in_use()
    if in_use is None:
        return None
    found = {}
    torch.manual_seed(0)
    data = [(torch.randn(8, 256), torch.randint(0, 10, (8,))) for _ in range(STEPS)]
    for strategy in ("ddp", "zero1", "zero2"):
        gc.collect()  # the strategy before: gone
        before = in_use()
        with MallocHighWater(in_use) as meter:
            layers: list[nn.Module] = []
            for _ in range(24):
                layers += [nn.Linear(256, 256), nn.Tanh()]
            net: nn.Module = nn.Sequential(*layers, nn.Linear(256, 10))
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
            if strategy == "ddp":
                net = DistributedDataParallel(net, bucket_cap_mb=0.25)
            else:
                net = ZeroDataParallel(net, int(strategy[-1]), bucket_cap_mb=0.25)
                opt = shard_optimizer(opt, net)
            for x, y in data:
                F.cross_entropy(net(x), y).backward()
                opt.step()
                opt.zero_grad()
        found[strategy] = meter.peak - before
        del net, opt
    return found


def first_bucket_overlaps(rank: int, world: int) -> dict[str, int]:
    """How often zero2's backward stopped to wait for a launched bucket before the next took its buffer: with DDP's
    small first bucket reducing while the large second one fills (the budget), and with no budget beyond none in
    flight (what it did before, which stalled the backward until the first bucket was done)."""
    found = {}
    for budgeted in (True, False):
        torch.manual_seed(0)
        # buckets: the last Linear, exactly 1 MiB (it closes the first bucket), then the rest (1.1 MiB)
        net = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 511), nn.Tanh(), nn.Linear(511, 512))
        model = ZeroDataParallel(net, 2)
        collective = model.reducer.collective
        assert isinstance(collective, ReduceScatter)
        if not budgeted:
            collective._budget = 0
        waits = 0
        real = collective._settle

        def counted(b: int, real: Any = real) -> None:
            nonlocal waits
            waits += 1
            real(b)

        collective._settle = counted  # type: ignore[method-assign]
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            model(x).square().mean().backward()
        found["budgeted" if budgeted else "none in flight"] = waits
    return found


def weights_after_step(rank: int, world: int) -> dict[str, Any]:
    """The peer steps late (it sleeps before every step): rank 0's reads right after its ``step()`` returned, of
    the parameters themselves (an EMA's read, no forward in between) and of a submodule's state dict, see the
    updated weights whole."""
    found: dict[str, Any] = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 600))
        model = ZeroDataParallel(net, stage, bucket_cap_mb=0.25)  # several buckets, gathered one after another
        opt = shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        whole = []
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            grads = [g.clone() for g in model.full_gradients()]
            expected = [p.detach() - 0.5 * g for p, g in zip(model.reducer.params, grads, strict=True)]
            if rank == 1:
                time.sleep(0.3)  # a peer that runs late: rank 0's step returns only once this one's gathers ran
            opt.step()
            read = [p.detach().clone() for p in model.reducer.params]
            last = net[4].state_dict()["weight"]
            whole.append(
                all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))
                and torch.equal(last, expected[[id(p) for p in model.reducer.params].index(id(net[4].weight))])
            )
        found[f"zero{stage}"] = {"read_whole": whole, "buckets": len(model.reducer.buckets)}
        model.close()
    return found


def suite(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every scenario that leaves the process group usable, in one set of processes (start-up is slow)."""
    return {
        "exactness": exactness(rank, world),
        "optimizer_surface": optimizer_surface(rank, world),
        "accumulation": accumulation(rank, world),
        "gradients_and_overflow": gradients_and_overflow(rank, world),
        "checkpoints": checkpoints(rank, world, directory),
        "tied_checkpoint": tied_checkpoint(rank, world, directory),
        "torch_utilities": torch_utilities(rank, world),
        "peak_memory": peak_memory(rank, world),
        "first_bucket_overlaps": first_bucket_overlaps(rank, world),
        "weights_after_step": weights_after_step(rank, world),
    }


def three_ranks(rank: int, world: int) -> dict[str, Any]:
    """Two configurations against ddp and one device, then a rank that never steps (it leaves the group unusable)."""
    found: dict[str, Any] = {"exactness": exactness(rank, world, ("adamw, fp32", "sgd momentum, accumulate 2, clip"))}
    found["skipped_step"] = a_rank_that_skips_the_step_is_named(rank, world)
    return found


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    """AdamW with bf16-mixed, accumulation, clipping and a schedule, against ddp."""
    return exactness(rank, world, ("adamw, bf16-mixed, accumulate 3, clip, schedule",), single=False)
