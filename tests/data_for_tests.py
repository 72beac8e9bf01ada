"""Callables for ``--data module:callable`` in tests: good splits in each form, and each way to get them wrong."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset


def _tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)  # (n, 6)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # three classes a model can learn
    return x, y


def tensor_splits() -> tuple[Any, Any]:
    return _tensors(96, 0), _tensors(32, 1)


def tensor_datasets() -> tuple[Any, Any]:
    return TensorDataset(*_tensors(96, 0)), TensorDataset(*_tensors(32, 1))


class Rows(Dataset):
    """A map-style Dataset that is not tensor-backed: each item built in Python from a list."""

    def __init__(self, n: int, seed: int, ragged: bool = False) -> None:
        x, y = _tensors(n, seed)
        self.rows = [(row.tolist(), int(label)) for row, label in zip(x, y, strict=True)]
        self.ragged = ragged

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        row, label = self.rows[i]
        if self.ragged and i == 5:
            row = row[:4]
        return torch.tensor(row), label


def python_datasets() -> tuple[Any, Any]:
    return Rows(96, 0), Rows(32, 1)


def raises() -> Any:
    raise FileNotFoundError("no such file: data/train.npy")


def one_split() -> Any:
    return _tensors(96, 0)[0]


def ragged() -> tuple[Any, Any]:
    return Rows(96, 0, ragged=True), Rows(32, 1)


def shapes_differ() -> tuple[Any, Any]:
    return _tensors(96, 0), (torch.randn(32, 7), torch.zeros(32, dtype=torch.long))


def integer_inputs() -> tuple[Any, Any]:
    return (torch.zeros(8, 6, dtype=torch.uint8), torch.zeros(8, dtype=torch.long)), _tensors(4, 1)


def float_targets() -> tuple[Any, Any]:
    x, y = _tensors(8, 0)
    return (x, y.float()), _tensors(4, 1)


def not_a_split() -> tuple[Any, Any]:
    return "train.csv", "test.csv"
