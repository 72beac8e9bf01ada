"""``Parallel.save`` and ``Parallel.load``: a training state through its strategy, as one file or sharded.

    save_state(strategy, {"model": model, "optimizer": optimizer, "step": 10}, "runs/a/step-10.pt")
    rest = load_state(strategy, "runs/a/step-10.pt", into={"optimizer": optimizer})

Prepared models and optimizers in a state are saved as the strategy holds them (:meth:`Strategy.model_state`,
:meth:`Strategy.optimizer_state`): whole state dicts, written by the main process into one file
(:mod:`paratrain.checkpoint.file`), or each process's slices under the sharded strategies, written by every process
into a directory (:mod:`paratrain.checkpoint.sharded`). Both hold the state a single process would save, so either
loads under any strategy and world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.file import load_checkpoint, save_checkpoint
from paratrain.checkpoint.sharded import has_shards, is_sharded_checkpoint, materialize, open_sharded, save_sharded
from paratrain.errors import CheckpointError, ConfigError
from paratrain.strategies import Strategy
from paratrain.tree import map_tensors

__all__ = ["load_state", "save_state"]


def save_state(strategy: Strategy, state: dict[str, Any], path: str | Path) -> Path | None:
    """Write ``state`` (every process calls it); the path written, in the main process."""
    target = Path(path)
    converted = {key: _state_of(strategy, value) for key, value in state.items()}
    if has_shards(converted):
        name = target.name.removesuffix(".pt")
        directory = save_sharded(
            converted,
            target.parent,
            name,
            rank=strategy.rank,
            world_size=strategy.world_size,
            barrier=strategy.barrier,
        )
        return directory if strategy.is_main else None
    written = save_checkpoint(converted, target.parent, target.name) if strategy.is_main else None
    strategy.barrier()
    return written


def _state_of(strategy: Strategy, value: Any) -> Any:
    if isinstance(value, nn.Module):
        return strategy.model_state(value)
    if isinstance(value, torch.optim.Optimizer):
        return strategy.optimizer_state(value)
    if isinstance(value, dict) and "paratrain_shard" in value:
        raise ConfigError(
            "the state to save holds one process's shard of an optimizer's state (its state_dict() under a sharded "
            "strategy); pass the optimizer itself, par.save({'optimizer': optimizer, ...}, path), so that every "
            "process writes its own shard"
        )
    return value


def load_state(strategy: Strategy, path: str | Path, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a state written by :func:`save_state` onto the strategy's device, loading ``into``'s objects in place."""
    device = strategy.device
    source = Path(path)
    if not source.exists() and is_sharded_checkpoint(source.with_suffix("")):
        source = source.with_suffix("")  # the path save_state was given: it wrote the directory without .pt
    sharded = is_sharded_checkpoint(source)
    if not sharded and not into:
        return load_checkpoint(source, map_location=device)
    state = open_sharded(source) if sharded else load_checkpoint(source)
    for key, obj in (into or {}).items():
        if key not in state:
            raise CheckpointError(f"checkpoint {source} has no {key!r} entry to load into the {type(obj).__name__}")
        value = state.pop(key)
        if isinstance(obj, torch.optim.Optimizer):
            strategy.load_optimizer_state(obj, value)
        elif isinstance(obj, nn.Module):
            strategy.load_model_state(obj, value)
        else:
            obj.load_state_dict(materialize(value))
    rest: dict[str, Any] = materialize(state)
    if device.type == "cpu":
        return rest
    moved: dict[str, Any] = map_tensors(lambda t: t.to(device), rest)
    return moved
