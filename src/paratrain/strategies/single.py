"""One device, no wrapping: the baseline every other strategy must agree with."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.strategies.base import Strategy

__all__ = ["SingleDevice"]


class SingleDevice(Strategy):
    """Train on exactly one device."""

    name = "single"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def devices(self) -> list[torch.device]:
        return [self._device]

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self._device)
