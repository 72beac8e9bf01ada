"""``Parallel.save`` and ``Parallel.load``: a training state through its strategy, as one file or sharded.

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 10}
    save_state(strategy, state, "runs/a/step-10.pt")
    rest = load_state(strategy, "runs/a/step-10.pt", into=state)   # objects restored in place, state["step"] set

Prepared models and optimizers in a state are saved as the strategy holds them (:meth:`Strategy.model_state`,
:meth:`Strategy.optimizer_state`): whole state dicts, written by the main process into one file
(:mod:`paratrain.checkpoint.file`), or each process's slices under the sharded strategies, written by every process
into a directory (:mod:`paratrain.checkpoint.sharded`). Both hold the state a single process would save, so either
loads under any strategy and world size, and both live at exactly the path given (:mod:`paratrain.checkpoint.location`:
a save replaces what stood there in either form). Any other object with ``state_dict`` and ``load_state_dict`` (an
LR scheduler, a gradient scaler, a sampler, the user's own) is saved as its state dict and loaded back in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.file import load_checkpoint, save_checkpoint
from paratrain.checkpoint.location import check_target, locate
from paratrain.checkpoint.sharded import materialize, open_sharded, save_sharded
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
    for value in state.values():
        _refuse_a_shard(value)
    meeting = strategy.meeting
    sharded = strategy.shards_checkpoints and any(
        isinstance(v, nn.Module | torch.optim.Optimizer) for v in state.values()
    )
    # where only the main process writes, only it checks (another node may not see the directory)
    target = check_target(path) if sharded or strategy.is_main else Path(path)
    if sharded:
        agree = None
        if meeting is not None:  # before any collective: a rank that went on is named, and nothing is half-written
            meeting.attend("sharded-save", range(strategy.world_size), "par.save()", lambda g: _every_rank(strategy, g))
            agree = _agreement(strategy, meeting)
        converted = {key: _state_of(strategy, value) for key, value in state.items()}
        directory = save_sharded(
            converted,
            target.parent,
            target.name,
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
    if _stateful(value):
        return value.state_dict()
    return value


def _stateful(value: Any) -> bool:
    """An object a checkpoint holds by its state dict (an LR scheduler, a GradScaler, a sampler, the user's own)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _refuse_a_shard(value: Any) -> None:
    if isinstance(value, dict) and "paratrain_shard" in value:
        raise ConfigError(
            "the state to save holds one process's shard of an optimizer's state (its state_dict() under a sharded "
            "strategy); pass the optimizer itself, par.save({'optimizer': optimizer, ...}, path), so that every "
            "process writes its own shard"
        )


def load_state(strategy: Strategy, path: str | Path, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a state written by :func:`save_state` onto the strategy's device; what ``into`` names is restored there.

    For each key of ``into``: a prepared model or optimizer is loaded in place through the strategy (an optimizer
    under a sharded strategy reads only its shard's slices), any other object with ``load_state_dict`` loads its
    saved state dict, and a plain value is replaced in ``into`` by the saved one. Returns the entries ``into`` did
    not name.

    Raises:
        CheckpointError: nothing at ``path`` (or two checkpoints there), a damaged checkpoint, a key of ``into``
            the checkpoint lacks, or a saved state that does not fit its object (keys, shapes), before it is loaded.
    """
    device = strategy.device
    found = locate(path)
    source = found.path
    if not found.sharded and not into:
        return load_checkpoint(source, map_location=device)
    state = open_sharded(source) if found.sharded else load_checkpoint(source)
    into = into if into is not None else {}
    missing = [key for key in into if key not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {source} has no {', '.join(map(repr, missing))} entry to load into; it holds "
            f"{', '.join(map(repr, state))}"
        )
    for key, obj in list(into.items()):
        value = state.pop(key)
        try:
            if isinstance(obj, torch.optim.Optimizer):
                strategy.load_optimizer_state(obj, value)
            elif isinstance(obj, nn.Module):
                strategy.load_model_state(obj, value)
            elif _stateful(obj):
                obj.load_state_dict(_on(device, materialize(value)))
            else:
                into[key] = _on(device, materialize(value))
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {source}, entry {key!r}: {exc}") from exc
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint {source}: its {key!r} entry does not fit the {type(obj).__name__} given for it "
                f"({type(exc).__name__}: {exc}); load the checkpoint of the same model and objects"
            ) from exc
    rest: dict[str, Any] = _on(device, materialize(state))
    return rest


def _on(device: torch.device, value: Any) -> Any:
    return value if device.type == "cpu" else map_tensors(lambda t: t.to(device), value)
