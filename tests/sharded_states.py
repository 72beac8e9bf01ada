"""Sharded checkpoints of any whole state, written as world N in this process (threads stand in for the ranks).

    path = save_as(3, tmp_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1})

Each rank writes its share of every model tensor and optimizer moment (contiguous ranges of the flattened
tensor, as no strategy splits them but as the layout allows), a tied weight's later keys as an Alias; the rest
is rank 0's. Reading it back gives ``whole``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.sharded import Alias, LocalSlices, save_sharded


def rank_state(whole: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` hands to save_sharded."""

    def sliced(tensor: torch.Tensor) -> LocalSlices:
        flat = tensor.detach().reshape(-1)
        bounds = [len(part) for part in flat.tensor_split(world)]
        start = sum(bounds[:rank])
        return LocalSlices(tuple(tensor.shape), tensor.dtype, [(start, flat[start : start + bounds[rank]])])

    model: dict[str, Any] = {}
    first: dict[int, str] = {}
    for key, tensor in whole["model"].items():
        if tensor.is_floating_point() and tensor.data_ptr() in first:
            model[key] = Alias(first[tensor.data_ptr()])
        elif tensor.is_floating_point() and tensor.dim():
            first[tensor.data_ptr()] = key
            model[key] = sliced(tensor)
        else:
            model[key] = tensor
    state = dict(whole, model=model)
    if "optimizer" in whole:
        moments = {
            index: {k: sliced(v) if k != "step" else v for k, v in entry.items()}
            for index, entry in whole["optimizer"]["state"].items()
        }
        state["optimizer"] = {**whole["optimizer"], "state": moments}
    return state


def save_in_threads(
    world: int,
    directory: Path,
    name: str,
    state_of: Callable[[int], dict[str, Any]],
    fail: Callable[[int], None] | None = None,
) -> Path:
    """Every rank of ``world`` saving ``state_of(rank)`` in its own thread, meeting at a barrier as the ranks of a
    job do (``fail(rank)`` first: a rank that raises ends the others' waits, as a dead rank ends a job)."""
    barrier = threading.Barrier(world)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            if fail is not None:
                fail(rank)
            save_sharded(state_of(rank), directory, name, rank=rank, world_size=world, barrier=barrier.wait)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return directory / name


def save_as(world: int, directory: Path, whole: dict[str, Any], name: str = "epoch-0001-step-000000") -> Path:
    """``whole`` as the sharded checkpoint ``directory/name`` that ``world`` ranks write; its path."""
    return save_in_threads(world, directory, name, lambda rank: rank_state(whole, world, rank))
