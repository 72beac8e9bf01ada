"""Several devices in one process through paratrain's own DataParallel."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paratrain.dp.data_parallel import DataParallel
from paratrain.strategies.base import Strategy

__all__ = ["DataParallelStrategy"]


class DataParallelStrategy(Strategy):
    """Split every batch across ``devices`` (GPUs, or repeated ``cpu`` for CPU replicas)."""

    name = "dp"

    def __init__(self, devices: Sequence[torch.device]) -> None:
        super().__init__()
        self._devices = list(devices)
        self._replicated: list[DataParallel] = []

    @property
    def device(self) -> torch.device:
        return self._devices[0]

    @property
    def devices(self) -> list[torch.device]:
        return list(self._devices)

    def _wrap(self, model: nn.Module) -> nn.Module:
        wrapped = DataParallel(model.to(self._devices[0]), device_ids=self._devices)
        self._replicated.append(wrapped)
        return wrapped

    def teardown(self, clean: bool = True) -> None:
        for wrapped in self._replicated:
            wrapped.close()
        self._replicated.clear()
