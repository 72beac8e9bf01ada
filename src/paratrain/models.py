"""Kept so that ``from paratrain.models import SimpleNet``, as earlier READMEs showed it, still works.

The models live in :mod:`paratrain.training.models` with the rest of the training application.
"""

from .training.models import MLP, DemoModel, SimpleCNN, SimpleNet

__all__ = ["MLP", "DemoModel", "SimpleCNN", "SimpleNet"]
