"""Named ranges in a user's profiler trace: paratrain's phases show as ``paratrain::...`` (as torch's and torchft's).

    with torch.profiler.profile() as prof:
        model(x).sum().backward()           # DataParallel, DistributedDataParallel
    # the trace holds paratrain::DataParallel.scatter, .replicate, .parallel_apply, .gather,
    # paratrain::DistributedDataParallel.all_reduce (bucket 0), ...

Outside a profiler a range costs one check of a flag: nothing is recorded.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["phase"]

_NOTHING: AbstractContextManager[Any] = nullcontext()


def phase(name: str) -> AbstractContextManager[Any]:
    """A profiler range called ``name`` while a profiler records; otherwise a context manager that does nothing."""
    if torch._C._autograd._profiler_enabled():  # torch's own check (kineto and the autograd profiler)
        return torch.profiler.record_function(name)
    return _NOTHING
