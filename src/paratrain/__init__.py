"""paratrain: take a PyTorch training loop from one device to many.

import paratrain
model = paratrain.DataParallel(model, device_ids=[0, 1])
par = paratrain.Parallel("auto")      # single, dp or ddp; then par.prepare(model, optimizer, loader)

``import paratrain`` loads the engine only (the modules beside this one). The training application
(``paratrain.training``: the train job, datasets, models) and the command line (``paratrain.cli``) load when
something asks for them.
"""

from .data_parallel import DataParallel
from .distributed import DistributedDataParallel
from .errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DeviceError,
    DistributedError,
    GatherError,
    ParatrainError,
    ReplicaError,
    ScatterError,
)
from .parallel import Parallel, seed_everything
from .scatter_gather import gather, scatter, split_sizes
from .strategies import Strategy
from .version import __version__

__all__ = [
    "CheckpointError",
    "ConfigError",
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
    "__version__",
    "gather",
    "scatter",
    "seed_everything",
    "split_sizes",
]
