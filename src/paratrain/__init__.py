"""paratrain: take a PyTorch training loop from one device to many.

import paratrain
model = paratrain.DataParallel(model, device_ids=[0, 1])
par = paratrain.Parallel("auto")      # single, dp or ddp; then par.prepare(model, optimizer, loader)

``import paratrain`` loads the engine only (the modules beside this one). The training application
(``paratrain.training``: the train job, datasets, models), the tools (``paratrain.tools``: verify, bench,
plan) and the command line (``paratrain.cli``) load when something asks for them: ``paratrain.verify(...)``,
``paratrain.bench(...)`` and ``paratrain.plan(...)`` import ``paratrain.tools`` on first use.
"""

import importlib as _importlib
from typing import Any as _Any

from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.ddp.options import DDPOptions
from paratrain.dp.data_parallel import DataParallel
from paratrain.dp.scatter_gather import gather, scatter, split_sizes
from paratrain.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DataError,
    DeviceError,
    DistributedError,
    GatherError,
    ParatrainError,
    ReplicaError,
    ScatterError,
    TrainingError,
)
from paratrain.parallel import Parallel, seed_everything
from paratrain.strategies import Strategy
from paratrain.version import __version__

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "DDPOptions",
    "DataError",
    "DataParallel",
    "DeviceError",
    "DistributedDataParallel",
    "DistributedError",
    "GatherError",
    "Parallel",
    "ParatrainError",
    "ReplicaError",
    "ScatterError",
    "Strategy",
    "TrainingError",
    "__version__",
    "bench",
    "gather",
    "plan",
    "scatter",
    "seed_everything",
    "split_sizes",
    "verify",
]

_TOOLS = ("bench", "plan", "verify")  # provided by paratrain.tools, imported on first access (PEP 562)


def __getattr__(name: str) -> _Any:
    if name in _TOOLS:
        # the application is loaded here, on demand, never by `import paratrain`
        return getattr(_importlib.import_module(f"{__name__}.tools"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_TOOLS])
