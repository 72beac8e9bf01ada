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

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.file import load_checkpoint, save_checkpoint
from paratrain.checkpoint.sharded import is_sharded_checkpoint, materialize, open_sharded, save_sharded
from paratrain.comm.meeting import Meeting
from paratrain.errors import CheckpointError, ConfigError
from paratrain.strategies import Strategy
from paratrain.tree import map_tensors

__all__ = ["load_state", "save_state"]


def save_state(strategy: Strategy, state: dict[str, Any], path: str | Path) -> Path | None:
    """Write ``state``; the path written, in the main process.

    A state the main process writes whole (single, dp, ddp; or no prepared model or optimizer in it) may be saved
    from the main process alone (``if par.is_main:``); any other process that calls it waits for the main
    process's word that the file is written. A state of slices (a prepared model or optimizer under zero1, zero2,
    zero3) needs every process: each writes its own. A process that calls it while another went on without
    calling it is told so as soon as that one launches its next collective (:mod:`paratrain.comm.meeting`).
    """
    target = Path(path)
    for value in state.values():
        _refuse_a_shard(value)
    meeting = strategy.meeting
    if strategy.shards_checkpoints and any(isinstance(v, nn.Module | torch.optim.Optimizer) for v in state.values()):
        agree = None
        if meeting is not None:  # before any collective: a rank that went on is named, and nothing is half-written
            meeting.attend("sharded-save", range(strategy.world_size), "par.save()", lambda g: _every_rank(strategy, g))
            agree = _agreement(strategy, meeting)
        converted = {key: _state_of(strategy, value) for key, value in state.items()}
        name = target.name.removesuffix(".pt")
        directory = save_sharded(
            converted,
            target.parent,
            name,
            rank=strategy.rank,
            world_size=strategy.world_size,
            barrier=strategy.barrier,
            agree=agree,
        )
        return directory if strategy.is_main else None
    if meeting is None:  # one process (or a group without a store: every rank calls it, and meets at a barrier)
        converted = {key: _state_of(strategy, value) for key, value in state.items()} if strategy.is_main else {}
        written = save_checkpoint(converted, target.parent, target.name) if strategy.is_main else None
        if strategy.world_size > 1:
            strategy.barrier()
        return written
    name = f"save-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"  # the path as every rank writes it
    if strategy.is_main:
        try:
            converted = {key: _state_of(strategy, value) for key, value in state.items()}
            written = save_checkpoint(converted, target.parent, target.name)
        except BaseException as exc:
            meeting.announce(name, f"{type(exc).__name__}: {exc}")
            raise
        meeting.announce(name, _WRITTEN)
        return written
    word = meeting.attend(name, [0], "par.save()", _main_went_on, come=False)[0]
    if word != _WRITTEN:
        raise CheckpointError(f"rank 0 could not write {target}: {word}")
    return None


_WRITTEN = "written"


def _agreement(strategy: Strategy, meeting: Meeting) -> Callable[[str | None], dict[int, str]]:
    """``save_sharded``'s ``agree``: each rank's word (``written``, or why not) in the store, then the strategy's
    barrier, which a rank that failed still comes to (and a peer that died fails at once); every rank's failure."""

    def agree(failure: str | None) -> dict[int, str]:
        words = meeting.exchange(
            "sharded-write",
            _WRITTEN if failure is None else failure,
            range(strategy.world_size),
            "par.save()",
            lambda gone: _every_rank(strategy, gone),
            sync=strategy.barrier,
        )
        failed = {rank: word for rank, word in words.items() if word != _WRITTEN}
        if failure is not None:
            failed[strategy.rank] = failure
        return failed

    return agree


def _every_rank(strategy: Strategy, gone: dict[int, str]) -> str:
    ranks = "; ".join(f"rank {rank} {how}" for rank, how in sorted(gone.items()))
    return (
        f"par.save() under {strategy.name} writes each process's own slices of the prepared models and optimizers, "
        f"so every rank must call it at the same point, but {ranks} instead. Call par.save(...) on every rank, not "
        f"under `if par.is_main:` (for one plain file, run `paratrain checkpoint consolidate` on what it writes)"
    )


def _main_went_on(gone: dict[int, str]) -> str:
    return (
        f"par.save() is written by the main process (rank 0), which went on without calling it (it "
        f"{gone.get(0, next(iter(gone.values())))}); call par.save(...) on every rank, or under `if par.is_main:`"
    )


def _state_of(strategy: Strategy, value: Any) -> Any:
    if isinstance(value, nn.Module):
        return strategy.model_state(value)
    if isinstance(value, torch.optim.Optimizer):
        return strategy.optimizer_state(value)
    return value


def _refuse_a_shard(value: Any) -> None:
    if isinstance(value, dict) and "paratrain_shard" in value:
        raise ConfigError(
            "the state to save holds one process's shard of an optimizer's state (its state_dict() under a sharded "
            "strategy); pass the optimizer itself, par.save({'optimizer': optimizer, ...}, path), so that every "
            "process writes its own shard"
        )


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
