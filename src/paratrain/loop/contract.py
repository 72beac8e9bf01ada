"""The contract every strategy keeps for a loop under ``Parallel``: what a script may not do, refused with the fix.

A model or optimizer prepared twice (DDP inside DDP, a batch cut twice), a step on gradients no ``par.backward``
made (``loss.backward()``, which skips the weighting of each process's share), and a step or clip on gradients a
``no_sync`` backward left unsynchronised each train another model without a word; each is refused at the call,
before any weight moves. The checks cost a comparison or two a step (a hook on every output cost 74 us of a 1.9 ms
SimpleNet step: 3.8%).

    contract = Contract()
    contract.check_not_prepared(obj, earlier)   # prepare(): each object once
    contract.took(obj, result)
    contract.backward_done(local=in_no_sync)    # par.backward()
    contract.before_step(optimizer, args, kwargs); contract.stepped(optimizer)   # a prepared optimizer's step
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError

__all__ = ["Contract", "params_of"]

_KINDS: tuple[tuple[type, str], ...] = ((nn.Module, "model"), (torch.optim.Optimizer, "optimizer"))


class Contract:
    """What one ``Parallel`` prepared, and how many backwards and steps its loop ran."""

    def __init__(self) -> None:
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()  # what prepare() took and returned: never twice
        self._backwards = 0  # par.backward() calls so far; a prepared optimizer's step needs one since its last
        self._stepped_at: dict[int, int] = {}  # a prepared optimizer (by id) -> self._backwards at its last step
        self._local_grads = False  # the latest backward ran inside no_sync: gradients are this process's own

    def check_not_prepared(self, obj: Any, before: tuple[Any, ...]) -> None:
        """Refuse an object prepare() already took (or returned): a model wrapped twice trains another model."""
        try:
            again = obj in self._prepared
        except TypeError:
            return
        again = again or (isinstance(obj, nn.Module | torch.optim.Optimizer) and any(obj is o for o in before))
        if again:
            kind = next((name for cls, name in _KINDS if isinstance(obj, cls)), "loader")
            raise ConfigError(
                f"prepare() got this {kind} ({type(obj).__name__}) a second time (the object itself, or "
                f"what prepare() returned for it): preparing it again would wrap it twice (a model inside two "
                f"wrappers, a batch cut twice), which trains another model. Pass each model, optimizer and loader "
                f"to prepare() once, and use what it returned: model, optimizer, loader = par.prepare(model, "
                f"optimizer, loader)"
            )

    def took(self, obj: Any, result: Any) -> None:
        """prepare() took ``obj`` and returned ``result``: neither may be prepared again."""
        with contextlib.suppress(TypeError):  # an object that takes no weak reference (a list of batches)
            self._prepared.add(result)
            if isinstance(obj, nn.Module | torch.optim.Optimizer):  # a loader may feed two prepared ones
                self._prepared.add(obj)

    def backward_done(self, *, local: bool) -> None:
        """par.backward() ran (``local``: inside no_sync, so the gradients are this process's own)."""
        self._backwards += 1
        self._local_grads = local

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` was prepared, or stepped: its next step needs a par.backward() after this one."""
        self._stepped_at[id(optimizer)] = self._backwards

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """A prepared optimizer is about to step: its gradients must be synchronised and made by par.backward()."""
        self.check_synchronised("optimizer.step()")
        closure = len(args) > 1 or (kwargs or {}).get("closure") is not None  # args: (optimizer, closure?)
        if self._stepped_at.get(id(optimizer)) == self._backwards and not closure:  # its backward runs inside
            self._refuse_plain_backward(optimizer)

    def _refuse_plain_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """A step on gradients that no par.backward() made since this optimizer's last step: loss.backward()."""
        if any(p.grad is not None for p in params_of(optimizer)):
            raise ConfigError(
                "optimizer.step() on gradients that no par.backward() made since this optimizer's last step: the "
                "loop calls loss.backward(), which skips par.backward()'s weighting of each process's loss by its "
                "share of the global batch (uneven shares drift) and its loss scaling under 16-mixed. Replace "
                "loss.backward() with par.backward(loss) (the raw paratrain.DistributedDataParallel keeps torch's "
                "loss.backward())"
            )

    def check_synchronised(self, what: str) -> None:
        if self._local_grads:
            raise ConfigError(
                f"{what} after a backward inside no_sync: the gradients are this process's own, not yet the "
                f"global batch's; call it after the last micro-batch's backward (after the par.accumulate() "
                f"loop, or after a backward outside no_sync)"
            )


def params_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]
