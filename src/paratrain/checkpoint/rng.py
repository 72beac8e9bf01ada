"""Capture and restore the random generators a training run draws from, in a weights-only loadable form.

state = rng_state()          # torch CPU, every CUDA device, Python's random
...
set_rng_state(state)         # later draws repeat exactly
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from paratrain.errors import CheckpointError

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """Capture the random number generators a training run draws from, in a weights-only loadable form.

    Covers torch's CPU generator, every CUDA device's generator (when CUDA is available) and Python's
    ``random``. NumPy's global generator is not included.
    """
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        # 625 words below 2**32: int64 holds them exactly, and a tensor pickles far smaller than 625 ints
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generators captured by :func:`rng_state`, so later draws repeat exactly.

    When this machine has a different number of CUDA devices than the one that saved the state, the devices
    both have are restored and a ``RuntimeWarning`` says the run will not repeat exactly.

    Raises:
        CheckpointError: ``state`` is not what :func:`rng_state` returns.
    """
    try:
        cpu_state = state["torch"]
        cuda_states = list(state["cuda"])
        python = state["python"]
        python_state = (
            int(python["version"]),
            tuple(int(word) for word in python["state"].tolist()),
            python["gauss_next"],
        )
    except (KeyError, TypeError, AttributeError) as err:
        found = sorted(map(str, state))[:5] if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(
            f"rng state must be the dict rng_state() returns, with keys 'torch', 'cuda' and 'python'; found {found} "
            f"({type(err).__name__}: {err})"
        ) from err
    if not isinstance(cpu_state, torch.Tensor):
        raise CheckpointError(
            f"rng state 'torch' must be a tensor from torch.get_rng_state(), found {type(cpu_state).__name__}"
        )

    # The generators want CPU byte tensors even for CUDA; a map_location may have moved them.
    torch.set_rng_state(cpu_state.cpu())
    random.setstate(python_state)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda_states) != available and (cuda_states or available):
        warnings.warn(
            f"the rng state holds {len(cuda_states)} CUDA generator(s) but this machine has {available} CUDA "
            f"device(s); restoring the first {min(len(cuda_states), available)}, so random draws will not repeat "
            "the original run exactly",
            RuntimeWarning,
            stacklevel=2,
        )
    for index, cuda_state in enumerate(cuda_states[:available]):
        torch.cuda.set_rng_state(cuda_state.cpu(), index)
