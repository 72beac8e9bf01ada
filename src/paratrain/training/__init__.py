"""The training application built on the engine: the ``paratrain train`` job and what it needs.

    from paratrain.training import TrainConfig, train
    result = train(TrainConfig(epochs=1, devices="cpu,cpu,cpu", quiet=True))   # a TrainResult

config.py (every setting, once), job.py (the loop, written only against ``Parallel``), datasets.py, models.py,
loader.py (``DeviceLoader``), progress.py, results.py. Nothing in the engine imports this package.
"""

from paratrain.training.config import TrainConfig
from paratrain.training.job import evaluate, train
from paratrain.training.results import TrainResult

__all__ = ["TrainConfig", "TrainResult", "evaluate", "train"]
