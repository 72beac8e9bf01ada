"""``--data module.path:callable``: the user's own training and test data, as ``--model`` takes the user's model.

    splits = load_user_data("mydata:splits")     # mydata.splits() -> (train, test)

The callable takes no arguments and returns ``(train, test)``, each either a pair of tensors ``(inputs,
targets)`` or a map-style torch ``Dataset`` whose items are ``(input, target)`` pairs. A ``TensorDataset`` of two
tensors is taken as its tensors; any other ``Dataset`` is read once, through a ``DataLoader`` (with worker
processes where the machine has cores to spare), into tensors. Either way the splits are held whole and go on
the fast path (:class:`~paratrain.training.loader.DeviceLoader`: each batch one index on the device), sharded,
shuffled and batched as the built-in datasets are. So a Dataset is read once per run, not once per epoch: a
random augmentation in its ``__getitem__`` is drawn once.

Inputs must be floating point, targets integer class indices (``0 .. num_classes - 1``, the number of classes
being the largest target plus one). Every process of a ddp run calls the callable itself: it must return the
same data each time (seed any randomness). Anything else is a :class:`~paratrain.errors.ConfigError` naming
``--data`` and the reason, before training starts.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from paratrain.errors import ConfigError
from paratrain.training.data import DatasetSplits, TensorData
from paratrain.training.model_spec import check_model_spec

__all__ = ["DATA_SPEC_HELP", "check_data_spec", "load_user_data"]

DATA_SPEC_HELP = (
    "your own data as module.path:callable, called with no arguments and returning (train, test): each a pair "
    "of tensors (inputs, targets) or a torch Dataset of (input, target) pairs; held whole on the training device"
)
_READ_BATCH = 256  # samples per batch while reading a Dataset into tensors


def check_data_spec(spec: str) -> None:
    """Import the callable ``spec`` names, without calling it.

    Raises:
        ConfigError: a malformed spec, a module that cannot be imported, a missing or non-callable attribute.
    """
    check_model_spec(spec, "--data", "mydata:splits")


def load_user_data(spec: str) -> DatasetSplits:
    """Call the callable ``spec`` names and hold its splits as tensors (see the module docstring).

    Raises:
        ConfigError: naming ``--data`` and the reason: the callable raised, returned something else than two
            splits, or gave splits whose samples disagree in shape or type.
    """
    factory = check_model_spec(spec, "--data", "mydata:splits")
    try:
        returned = factory()
    except Exception as exc:  # whatever the user's code raises is a problem with the data the user gave
        raise ConfigError(f"--data {spec}: {spec}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(returned, (tuple, list)) or len(returned) != 2:
        raise ConfigError(
            f"--data {spec}: returned {_described(returned)}; expected (train, test), each a pair of tensors "
            f"(inputs, targets) or a torch Dataset"
        )
    train, test = (_as_tensors(spec, split, what) for split, what in zip(returned, ("train", "test"), strict=True))
    shape = tuple(train.inputs.shape[1:])
    if tuple(test.inputs.shape[1:]) != shape:
        raise ConfigError(
            f"--data {spec}: train samples have shape {shape} but test samples {tuple(test.inputs.shape[1:])}; "
            f"both splits must give inputs of one shape"
        )
    if len(train) == 0:
        raise ConfigError(f"--data {spec}: the train split is empty")
    classes = int(max(train.targets.max().item(), test.targets.max().item() if len(test) else 0)) + 1
    return DatasetSplits(spec, train, test, num_classes=max(classes, 2), input_shape=shape)


def _described(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _as_tensors(spec: str, split: Any, what: str) -> TensorData:
    """One split as TensorData: float inputs (N, ...), int64 targets (N,)."""
    if isinstance(split, TensorDataset) and len(split.tensors) == 2:
        inputs, targets = split.tensors
    elif isinstance(split, (tuple, list)) and len(split) == 2 and all(isinstance(t, torch.Tensor) for t in split):
        inputs, targets = split
    elif isinstance(split, Dataset):
        inputs, targets = _read(spec, split, what)
    else:
        raise ConfigError(
            f"--data {spec}: the {what} split is {_described(split)}; expected a pair of tensors (inputs, targets) "
            f"or a torch Dataset"
        )
    if not inputs.is_floating_point():
        raise ConfigError(
            f"--data {spec}: the {what} inputs are {inputs.dtype}; give floating-point inputs (images as "
            f"x.float() / 255, say)"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ConfigError(
            f"--data {spec}: the {what} targets are {targets.dtype}; give integer class indices (targets.long())"
        )
    if targets.dim() != 1 or inputs.dim() < 1 or len(inputs) != len(targets):
        raise ConfigError(
            f"--data {spec}: the {what} inputs have shape {tuple(inputs.shape)} and targets {tuple(targets.shape)}; "
            f"expected inputs (N, ...) and targets (N,) with the same N"
        )
    if len(targets) and int(targets.min()) < 0:
        raise ConfigError(f"--data {spec}: the {what} targets include {int(targets.min())}; class indices start at 0")
    return TensorData(inputs.detach().to("cpu", torch.float32).contiguous(), targets.detach().to("cpu", torch.int64))


def _read(spec: str, dataset: Dataset[Any], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A map-style Dataset read once through a DataLoader into (inputs, targets)."""
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"--data {spec}: the {what} split is a {type(dataset).__name__} without a length; give a map-style "
            f"Dataset (with __len__ and __getitem__) or tensors"
        ) from None
    first = dataset[0] if size else None
    if size and not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise ConfigError(
            f"--data {spec}: item 0 of the {what} split is {_described(first)}; each item must be an (input, target) "
            f"pair"
        )
    spare = (os.cpu_count() or 1) - 1
    workers = min(4, spare) if size > 10 * _READ_BATCH else 0  # starting workers costs more than a small read
    loader = DataLoader(dataset, batch_size=_READ_BATCH, shuffle=False, num_workers=workers)
    inputs, targets = [], []
    seen = 0
    try:
        for x, y in loader:
            inputs.append(torch.as_tensor(x))
            targets.append(torch.as_tensor(y))
            seen += len(inputs[-1])
    except RuntimeError as exc:  # default_collate: items of different shapes cannot stack into one batch
        raise ConfigError(
            f"--data {spec}: the {what} split's samples near item {seen} do not stack into a batch ({exc}); every "
            f"input must have one shape"
        ) from exc
    if not inputs:
        return torch.empty(0), torch.empty(0, dtype=torch.int64)
    try:
        return torch.cat(inputs), torch.cat(targets)
    except RuntimeError as exc:
        raise ConfigError(
            f"--data {spec}: the {what} split's samples do not all have one shape ({exc}); every input must have one "
            f"shape"
        ) from exc
