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
from .ddp import DistributedStrategy, launched_by_torchrun
from .dp import DataParallelStrategy
from .single import SingleDevice

__all__ = [
    "STRATEGY_NAMES",
    "DataParallelStrategy",
    "DistributedStrategy",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "launched_by_torchrun",
    "resolve_devices",
    "select_strategy",
]

STRATEGY_NAMES = ("auto", "single", "dp", "ddp")


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


def select_strategy(
    name: str = "auto", devices: str | Sequence[DeviceLike] | None = "auto", *, timeout: float | None = None
) -> Strategy:
    """The strategy called ``name`` on ``devices``.

    ``auto`` picks ``ddp`` in a process started by torchrun (``paratrain launch``), else ``dp`` when several
    devices are in play (every visible GPU when there are several, or an explicit list such as
    ``cpu,cpu,cpu``), else ``single``. ``ddp`` takes ``devices`` ``auto`` (this process's GPU, or the CPU),
    ``cpu`` or ``cuda``.
    """
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGY_NAMES)}")
    if name == "ddp" or (name == "auto" and launched_by_torchrun()):
        device_type = devices if isinstance(devices, str) and devices in ("auto", "cpu", "cuda") else None
        if device_type is None:
            raise ConfigError(
                f"strategy 'ddp' takes --devices auto, cpu or cuda (each process uses one device: its local "
                f"rank's GPU, or the CPU); found {devices!r}"
            )
        return DistributedStrategy(device_type, **({} if timeout is None else {"timeout": timeout}))
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
