"""Ways of running a training loop, each a small class behind :class:`Strategy`.

strategy = select_strategy("auto", "cpu,cpu,cpu")    # -> dp over three CPU replicas
strategy = select_strategy("single", "cuda:1")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import DeviceLike, parse_device_list, parse_devices_arg, visible_gpus
from ..errors import ConfigError
from .base import ReduceOp, Strategy
from .dp import DataParallelStrategy
from .single import SingleDevice

__all__ = [
    "STRATEGY_NAMES",
    "DataParallelStrategy",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "resolve_devices",
    "select_strategy",
]

STRATEGY_NAMES = ("auto", "single", "dp")


def resolve_devices(devices: str | Sequence[DeviceLike] | None) -> list[torch.device]:
    """``auto``/None: every GPU, or the CPU without one; otherwise the devices given, checked to exist."""
    if devices is None:
        parsed = None
    elif isinstance(devices, str):
        parsed = parse_devices_arg(devices)
    else:
        parsed = parse_device_list(devices, what="devices")
    if parsed is None:
        parsed = visible_gpus() or [torch.device("cpu")]
    return parsed


def select_strategy(name: str = "auto", devices: str | Sequence[DeviceLike] | None = "auto") -> Strategy:
    """The strategy called ``name`` on ``devices``.

    ``auto`` picks ``dp`` when several devices are in play (every visible GPU when there are several, or an
    explicit list such as ``cpu,cpu,cpu``), else ``single``.
    """
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
    resolved = resolve_devices(devices)
    if name == "auto":
        name = "dp" if len(resolved) > 1 else "single"
    if name == "single":
        if len(resolved) != 1:
            raise ConfigError(
                f"strategy 'single' runs on one device but {len(resolved)} were given "
                f"({', '.join(map(str, resolved))}); pass one device or use --strategy dp"
            )
        return SingleDevice(resolved[0])
    return DataParallelStrategy(resolved)
