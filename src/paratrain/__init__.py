"""paratrain: take a PyTorch training loop from one device to many.

import paratrain
model = paratrain.DataParallel(model, device_ids=[0, 1])
"""

from .data_parallel import DataParallel
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
from .scatter_gather import gather, scatter, split_sizes
from .version import __version__

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DataParallel",
    "DeviceError",
    "DistributedError",
    "GatherError",
    "ParatrainError",
    "ReplicaError",
    "ScatterError",
    "__version__",
    "gather",
    "scatter",
    "split_sizes",
]
