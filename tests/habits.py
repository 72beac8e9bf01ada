"""Users' habits against every strategy (issue 25): the lines real training scripts carry, each run as a script would.

Each habit is a short training run through ``Parallel`` that ends with the model's weights (after any EMA or
reload the habit does) as one flat tensor, or raises the error the strategy gives for a line it cannot honour. The
cells are run in-process for ``single`` and ``dp`` (tests/test_habits.py) and in one torchrun launch of two ranks
for ``ddp``, ``zero1``, ``zero2`` and ``zero3`` (tests/scripts/habit_matrix.py). :data:`EXPECTED` says for every
cell whether it trains the same model as the reference (one device for single and dp; ddp for the zero stages) or
is refused, and with which words; :func:`table` is the user-facing table in docs/sharding.md. The weights are read
through ``state_dict()`` (under zero3 a collective that gathers them: every rank reads them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import paratrain

STRATEGIES = ("single", "dp", "ddp", "zero1", "zero2", "zero3")
PROCESS_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STEPS = 3
GLOBAL_BATCH = 8
SAME = "same"


class Tied(nn.Module):
    """nanoGPT's shape in small: an embedding whose weight is also the output head's, and a body between."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(12, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.wte(tokens))))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def data(tokens: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    if tokens:
        return [
            (torch.randint(0, 12, (GLOBAL_BATCH,), generator=g), torch.randint(0, 12, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)
        ]
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def flat(module: nn.Module) -> torch.Tensor:
    """The parameters, in order, from ``state_dict()`` (whole under every strategy; zero3 gathers them)."""
    state = module.state_dict()
    return torch.cat([state[name].detach().reshape(-1).cpu() for name, _ in module.named_parameters()])


Step = Callable[[paratrain.Parallel, nn.Module, torch.optim.Optimizer], None]


def _loop(
    par: paratrain.Parallel,
    *,
    net: nn.Module | None = None,
    after_backward: Step | None = None,
    after_step: Callable[[paratrain.Parallel, nn.Module, int], None] | None = None,
    tokens: bool = False,
) -> torch.Tensor:
    """prepare(model, SGD with momentum, loader), then par.backward, the habit, step, zero_grad."""
    net = net if net is not None else mlp()
    optimizer = torch.optim.SGD((p for p in net.parameters() if p.requires_grad), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data(tokens))
    for i, (x, y) in enumerate(loader):
        par.backward(F.cross_entropy(model(x), y))
        if after_backward is not None:
            after_backward(par, model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(par, model, i)
    return flat(par.unwrap(model))


def _steps(
    par: paratrain.Parallel, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, set_to_none: bool = True
) -> None:
    for x, y in loader:
        par.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


# -- the habits -----------------------------------------------------------------------------------------------


def par_clip(par: paratrain.Parallel) -> torch.Tensor:
    return _loop(par, after_backward=lambda par, model, opt: par.clip_grad_norm_(model, 0.5))


def torch_clip(par: paratrain.Parallel) -> torch.Tensor:
    return _loop(
        par,
        after_backward=lambda par, model, opt: torch.nn.utils.clip_grad_norm_(par.unwrap(model).parameters(), 0.5),
    )


def torch_clip_value(par: paratrain.Parallel) -> torch.Tensor:
    return _loop(
        par,
        after_backward=lambda par, model, opt: torch.nn.utils.clip_grad_value_(par.unwrap(model).parameters(), 0.05),
    )


def hand_norm(par: paratrain.Parallel) -> torch.Tensor:
    logged: list[float] = []

    def log(par: paratrain.Parallel, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        logged.append(float(sum(p.grad.norm() ** 2 for p in par.unwrap(model).parameters()) ** 0.5))  # type: ignore[union-attr]

    return _loop(par, after_backward=log)


def scheduler_before_prepare(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))  # the user's object
    model, optimizer, loader = par.prepare(net, optimizer, data())
    for x, y in loader:
        par.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return flat(par.unwrap(model))


def optimizer_never_prepared(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, loader = par.prepare(net, data())  # the optimizer left out
    _steps(par, model, optimizer, loader)
    return flat(par.unwrap(model))


def optimizer_after_prepare(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    model, loader = par.prepare(net, data())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # over the prepared model, never prepared
    _steps(par, model, optimizer, loader)
    return flat(par.unwrap(model))


def second_optimizer(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    body = torch.optim.SGD([*net[0].parameters(), *net[2].parameters()], lr=0.1, momentum=0.9)
    head = torch.optim.AdamW(net[4].parameters(), lr=1e-2)
    model, body, head, loader = par.prepare(net, body, head, data())
    for x, y in loader:
        par.backward(F.cross_entropy(model(x), y))
        body.step()
        head.step()
        body.zero_grad()
        head.zero_grad()
    return flat(par.unwrap(model))


def zero_grad_keeping_tensors(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    _steps(par, model, optimizer, loader, set_to_none=False)
    return flat(par.unwrap(model))


def two_backwards_per_step(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    for x, y in loader:
        par.backward(F.cross_entropy(model(x), y) / 2)
        par.backward(F.cross_entropy(model(x * 0.5), y) / 2)
        optimizer.step()
        optimizer.zero_grad()
    return flat(par.unwrap(model))


def weight_ema(par: paratrain.Parallel) -> torch.Tensor:
    """timm's ModelEmaV2: the EMA of every entry of the model's ``state_dict()`` after each step."""
    ema: list[torch.Tensor] = []

    def update(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        weights = [t.detach().clone() for t in par.unwrap(model).state_dict().values()]
        if not ema:
            ema.extend(weights)
        else:
            for e, w in zip(ema, weights, strict=True):
                e.mul_(0.9).add_(w, alpha=0.1)

    _loop(par, after_step=update)
    return torch.cat([e.reshape(-1) for e in ema])


def parameter_ema(par: paratrain.Parallel) -> torch.Tensor:
    """The most common read between steps: an EMA over ``model.parameters()``, no forward in between."""
    ema: list[torch.Tensor] = []

    def update(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        with torch.no_grad():
            if not ema:
                ema.extend(p.detach().clone() for p in par.unwrap(model).parameters())
            else:
                for e, p in zip(ema, par.unwrap(model).parameters(), strict=True):
                    e.lerp_(p, 0.1)

    _loop(par, after_step=update)
    return torch.cat([e.reshape(-1) for e in ema])


def full_weights_ema(par: paratrain.Parallel) -> torch.Tensor:
    """The same EMA inside ``par.full_weights(model)``: one script for every strategy."""
    ema: list[torch.Tensor] = []

    def update(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        with torch.no_grad(), par.full_weights(model) as module:
            if not ema:
                ema.extend(p.detach().clone() for p in module.parameters())
            else:
                for e, p in zip(ema, module.parameters(), strict=True):
                    e.lerp_(p, 0.1)

    _loop(par, after_step=update)
    return torch.cat([e.reshape(-1) for e in ema])


def rollback_between_steps(par: paratrain.Parallel) -> torch.Tensor:
    """``load_state_dict`` of weights kept earlier, between a step and the next forward (a rollback)."""
    kept: dict[str, torch.Tensor] = {}

    def roll(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        if step == 0:
            kept.update({k: v.detach().clone() for k, v in par.unwrap(model).state_dict().items()})
        if step == 1:
            par.unwrap(model).load_state_dict(kept)

    return _loop(par, after_step=roll)


def state_dict_on_main_only(par: paratrain.Parallel) -> torch.Tensor:
    refused: list[paratrain.ConfigError] = []

    def take(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        # after the first step: the peer's next forward is the collective it goes on to (after the last one, rank
        # 0's call would pair with the peer's own state_dict() that ends the script, the same gathering)
        if par.is_main and step == 0:
            try:
                model.state_dict()  # zero3: a gathering; refused on rank 0, which trains on as the others do
            except paratrain.ConfigError as exc:
                refused.append(exc)

    weights = _loop(par, after_step=take)
    if refused:
        raise refused[0]
    return weights


def state_dict_round_trip(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    _steps(par, model, optimizer, loader)
    plain = mlp()
    plain.load_state_dict(copy.deepcopy(par.unwrap(model).state_dict()))  # what a script saves and loads
    return flat(plain)


def prepared_state_dict_into_plain(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    _steps(par, model, optimizer, loader)
    saved = copy.deepcopy(model.state_dict())  # the prepared model's: torch.save(model.state_dict(), path)
    plain = mlp()
    plain.load_state_dict(saved)  # the user's own keys, no "module." prefix
    model.load_state_dict(saved)  # and the prepared model takes them back
    return flat(plain)


def load_plain_checkpoint_first(par: paratrain.Parallel) -> torch.Tensor:
    torch.manual_seed(11)
    start = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).state_dict()
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    par.unwrap(model).load_state_dict(start)  # a plain checkpoint, after prepare, before training
    _steps(par, model, optimizer, loader)
    return flat(par.unwrap(model))


def eval_on_main_only(par: paratrain.Parallel) -> torch.Tensor:
    refused: list[paratrain.ConfigError] = []

    def evaluate(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        if par.is_main:
            try:
                with torch.no_grad():
                    model(torch.ones(3, 6))
            except paratrain.ConfigError as exc:  # zero3: refused on rank 0; it trains on, so the others finish
                refused.append(exc)

    weights = _loop(par, after_step=evaluate)
    if refused:
        raise refused[0]
    return weights


def tied_weights(par: paratrain.Parallel) -> torch.Tensor:
    torch.manual_seed(0)
    return _loop(par, net=Tied(), tokens=True)


def frozen_layer(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    for p in net[0].parameters():
        p.requires_grad_(False)  # before prepare
    return _loop(par, net=net)


def save_on_main_only(par: paratrain.Parallel, directory: Path) -> torch.Tensor:
    refused: list[paratrain.ConfigError] = []

    def save(par: paratrain.Parallel, model: nn.Module, step: int) -> None:
        if par.is_main:
            try:
                par.save({"model": model, "step": step}, directory / f"{par.strategy_name}-main-only.pt")
            except paratrain.ConfigError as exc:  # only rank 0 calls it: the others train on, so it does too
                refused.append(exc)

    weights = _loop(par, after_step=save)
    if refused:
        raise refused[0]
    return weights


def prepare_twice(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    model, optimizer, loader = par.prepare(model, optimizer, loader)  # a second call: refused at once
    return flat(par.unwrap(model))


def plain_loss_backward(par: paratrain.Parallel) -> torch.Tensor:
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = par.prepare(net, optimizer, data())
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()  # where par.backward(loss) belongs
        optimizer.step()
        optimizer.zero_grad()
    return flat(par.unwrap(model))


HABITS: dict[str, Callable[..., torch.Tensor]] = {
    "`par.clip_grad_norm_(model, 0.5)`": par_clip,
    "`torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)` (nanoGPT's line)": torch_clip,
    "`torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)`": torch_clip_value,
    "gradient norm logged by hand from `p.grad`": hand_norm,
    "LR scheduler built on the optimizer before `prepare`": scheduler_before_prepare,
    "optimizer over `model.parameters()` never passed to `prepare`": optimizer_never_prepared,
    "optimizer built after `prepare` from the prepared model": optimizer_after_prepare,
    "two optimizers over parts of the model (SGD body, AdamW head)": second_optimizer,
    "`optimizer.zero_grad(set_to_none=False)`": zero_grad_keeping_tensors,
    "two `par.backward` calls before one step": two_backwards_per_step,
    "EMA of the weights after each step": weight_ema,
    "EMA over `model.parameters()` after each step": parameter_ema,
    "the same EMA inside `with par.full_weights(model)`": full_weights_ema,
    "`load_state_dict` of earlier weights between a step and the next forward": rollback_between_steps,
    "`if par.is_main: model.state_dict()`": state_dict_on_main_only,
    "`par.unwrap(model).state_dict()` loaded into a plain model": state_dict_round_trip,
    "the prepared model's `state_dict()` loaded into a plain model": prepared_state_dict_into_plain,
    "`load_state_dict` of a plain checkpoint after `prepare`": load_plain_checkpoint_first,
    "evaluation under `torch.no_grad()` on rank 0 only": eval_on_main_only,
    "tied weights (`head.weight is wte.weight`)": tied_weights,
    "a layer frozen (`requires_grad=False`) before `prepare`": frozen_layer,
    "`if par.is_main: par.save(...)`": save_on_main_only,
    "`par.prepare` twice": prepare_twice,
    "`loss.backward()` instead of `par.backward(loss)`": plain_loss_backward,
}

_CLIP = "par.clip_grad_norm_"
_SHARDED_GRAD = "no rank holds a parameter's whole gradient"
_PREPARE_TWICE = "a second time (the object itself, or what prepare() returned for it)"
_PLAIN_BACKWARD = "Replace loss.backward() with par.backward(loss)"
_EVERY_RANK = "every rank must call it at the same point"


_ONE_RANK_FORWARD = "a forward under torch.no_grad() that not every rank runs"
_RESTING_WEIGHTS = "par.full_weights(model)"
_ONE_RANK_GATHER = "model.state_dict() that not every rank calls"


def _cells(zero2: str = SAME, zero1: str = SAME, zero3: str | None = None, everywhere: str = SAME) -> dict[str, str]:
    """The expected cells: ``zero3`` as ``zero2`` unless given."""
    cells = dict.fromkeys(STRATEGIES, everywhere)
    if everywhere == SAME:
        cells["zero1"], cells["zero2"], cells["zero3"] = zero1, zero2, zero2 if zero3 is None else zero3
    return cells


# each cell: SAME (the same model as the reference: one device for single and dp, ddp for zero1 and zero2), or
# the words the refusal carries
EXPECTED: dict[str, dict[str, str]] = {name: _cells() for name in HABITS}
for _name, _fn in HABITS.items():
    if _fn in (torch_clip, torch_clip_value, hand_norm, optimizer_never_prepared, optimizer_after_prepare):
        EXPECTED[_name] = _cells(zero2=_SHARDED_GRAD)
    elif _fn is save_on_main_only:
        EXPECTED[_name] = _cells(zero1=_EVERY_RANK, zero2=_EVERY_RANK)
    elif _fn is eval_on_main_only:
        EXPECTED[_name] = _cells(zero3=_ONE_RANK_FORWARD)
    elif _fn is parameter_ema:
        EXPECTED[_name] = _cells(zero3=_RESTING_WEIGHTS)
    elif _fn is state_dict_on_main_only:
        EXPECTED[_name] = _cells(zero3=_ONE_RANK_GATHER)
    elif _fn is prepare_twice:
        EXPECTED[_name] = _cells(everywhere=_PREPARE_TWICE)
    elif _fn is plain_loss_backward:
        EXPECTED[_name] = _cells(everywhere=_PLAIN_BACKWARD)

WHY = {  # the fix each refusal names, for the docs' table
    _SHARDED_GRAD: f"refused: gradients are sharded; `{_CLIP}(model, max_norm)`, or a prepared optimizer",
    _EVERY_RANK: "refused at once: every rank writes its slices; call `par.save` on every rank",
    _ONE_RANK_FORWARD: "refused at once on rank 0: every rank runs every forward; evaluate on every rank",
    _PREPARE_TWICE: "refused: pass each object to `prepare` once",
    _RESTING_WEIGHTS: "refused: no rank holds whole weights between steps; read them inside `par.full_weights(model)`",
    _ONE_RANK_GATHER: "refused at once on rank 0: it gathers from every rank; call it on every rank, rank 0 writes",
    _PLAIN_BACKWARD: "refused at the next step: use `par.backward(loss)`",
}


def run(name: str, strategy: str, directory: Path, devices: str = "cpu") -> dict[str, Any]:
    """One cell: the habit under ``strategy``; its weights, or the refusal's type and message."""
    habit = HABITS[name]
    timeout = {"timeout": 120} if strategy in PROCESS_STRATEGIES else {}
    with paratrain.Parallel(strategy, devices, **timeout) as par:
        try:
            weights = habit(par, directory) if habit is save_on_main_only else habit(par)
        except paratrain.ConfigError as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"weights": weights.tolist()}


def table() -> str:
    """The matrix as docs/sharding.md shows it."""
    lines = [
        "| what the script does | " + " | ".join(STRATEGIES) + " |",
        "|---|" + "---|" * len(STRATEGIES),
    ]
    for name, cells in EXPECTED.items():
        shown = ["same model" if cell == SAME else WHY[cell] for cell in (cells[s] for s in STRATEGIES)]
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)
