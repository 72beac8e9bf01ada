"""What every sharded strategy (zero1, zero2, zero3) does alike: its wrappers, the sharded optimizer, the norm.

    class ZeroStrategy(ShardedStrategy): ...       # buckets of our DDP, sharded
    class Zero3Strategy(ShardedStrategy): ...      # units of whole modules, sharded

Each keeps the wrappers it put around models (:meth:`ShardedStrategy.wrappers`) and says which parameters a
wrapper trains and in which dtype its shards are; from those, one optimizer per model is sharded in place (the
user's object, so a scheduler built before ``prepare`` keeps driving it), saved and loaded slice by slice, and the
global gradient is clipped as torch clips it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.sharded import materialize
from paratrain.compiled import without_compiled
from paratrain.errors import ConfigError
from paratrain.sharded.optimizer import ShardedOptimizer, shard_optimizer
from paratrain.strategies.ddp import DistributedStrategy

__all__ = ["ShardedStrategy"]


class ShardedStrategy(DistributedStrategy):
    """One process per device; each model's training state split across them (see the module docstring)."""

    shards_checkpoints = True

    def wrappers(self) -> list[Any]:
        """The wrappers this strategy put around models, in the order it made them."""
        raise NotImplementedError

    @staticmethod
    def trained(wrapper: Any) -> Sequence[torch.Tensor]:
        """The parameters ``wrapper`` shards and trains."""
        raise NotImplementedError

    def wrapper_of(self, model: nn.Module, what: str) -> Any:
        """The wrapper this strategy put around ``model`` (given as prepared, or as the user's module)."""
        plain = without_compiled(model)  # torch.compile's wrapper around the prepared model, or inside it
        found = next((w for w in self.wrappers() if plain in (w, without_compiled(w.module))), None)
        if found is None:
            raise ConfigError(
                f"{what} under {self.name} takes the model par.prepare() returned (or the module inside it), whose "
                f"training state is sharded across ranks; found a {type(model).__name__} it did not prepare"
            )
        return found

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [w for w in self.wrappers() if any(id(p) in params for p in self.trained(w))]
        if len(owners) != 1:
            why = "no model prepared so far holds its parameters" if not owners else "it spans several models"
            raise ConfigError(
                f"under {self.name} an optimizer is sharded like the one model it trains, but {why}: prepare the "
                f"model first, in the same call or before (par.prepare(model, optimizer)), one optimizer per model"
            )
        return shard_optimizer(optimizer, owners[0], in_place=True)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer.sharded_state_dict()
        return super().optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.load_state_dict(state)  # reads only the slices of this rank's pieces
            return
        optimizer.load_state_dict(materialize(state))

    def clip_grad_norm_(self, module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` under DDP, bit for bit: the wrapper's (each parameter's norm from its whole
        gradient, torch's total and coefficient, this rank's pieces scaled)."""
        wrapper = self.wrapper_of(module, "clip_grad_norm_()")
        norm: torch.Tensor = wrapper.clip_grad_norm_(max_norm, norm_type)
        return norm
