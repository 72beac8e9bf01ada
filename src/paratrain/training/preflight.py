"""What the launching process checks before ddp's workers start, so that a usage error is one line, once.

    preflight(config)       # ConfigError or DataError here, instead of one per rank after torchrun starts them

Each worker would find the same mistake (a model that cannot be built, or that does not take the data; MNIST
files that are missing and cannot be downloaded) and report it once per rank, followed by torchrun's failure
report. Here the model is built on the meta device (no memory, no compute) and run on two samples' shapes, and
MNIST's files are fetched once, not by every rank at the same time.
"""

from __future__ import annotations

import torch

from paratrain.errors import ConfigError
from paratrain.training.config import TrainConfig
from paratrain.training.data import parse_input_shape
from paratrain.training.datasets import dataset_shape, load_dataset
from paratrain.training.fit import check_fits
from paratrain.training.model_spec import build_model_spec
from paratrain.training.user_data import load_user_data

__all__ = ["preflight"]


def preflight(config: TrainConfig) -> None:
    """Check the model against the data, and fetch MNIST, in this process (see the module docstring).

    Raises:
        ConfigError: a model that cannot be built, or does not take the dataset's inputs.
        DataError: MNIST files missing from ``--data-dir`` that cannot be downloaded, or corrupt.
    """
    if config.data is not None:  # the user's callable, called once here: its errors are reported once
        splits = load_user_data(config.data)
        shape, classes = splits.input_shape, splits.num_classes
    else:
        given = parse_input_shape(config.input_shape) if config.input_shape is not None else None
        shape, classes = dataset_shape(config.dataset_name, given, config.num_classes)
    try:
        with torch.device("meta"):
            model = build_model_spec(config.model, shape, classes, width=config.width, depth=config.depth)
    except ConfigError:
        # the factory may need real tensors to build (loading weights, say): only a failure here too is the model's
        model = build_model_spec(config.model, shape, classes, width=config.width, depth=config.depth)
        del model
    else:
        check_fits(model, torch.empty((2, *shape), device="meta"), input_shape=shape, spec=config.model, meta=True)
    if config.dataset_name == "mnist":
        load_dataset("mnist", config.data_dir, verify=config.verify_data)
