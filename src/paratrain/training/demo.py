"""The DataParallel tutorial's demo (``paratrain demo``): how DataParallel splits each batch.

A random dataset (100 vectors of 5 features), a Linear(5, 2) model that prints the size of what each replica
receives, batches of 30::

    paratrain demo                          # every GPU, or two CPU replicas without one
    paratrain demo --devices cpu,cpu,cpu    # 30 samples -> 10 per replica
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from paratrain.devices import parse_devices_arg, visible_gpus
from paratrain.dp.data_parallel import DataParallel
from paratrain.dp.scatter_gather import split_sizes
from paratrain.settings import Settings, at_least, setting
from paratrain.training.models import DemoModel, print_line

__all__ = ["DemoConfig", "RandomDataset", "default_demo_devices", "demo", "run_demo"]


@dataclass
class DemoConfig(Settings):
    """The demo's settings: the tutorial's 100 random vectors of 5 features, in batches of 30."""

    devices: str = setting("auto", "auto (every GPU, or cpu,cpu without one), cpu,cpu,cpu, 0,1, ...")
    batch_size: int = setting(30, "samples per batch, split across the devices", check=at_least(1))
    data_size: int = setting(100, "random samples in the dataset", check=at_least(1))
    seed: int = setting(0, "seeds the data, the shuffle order and the model")


def demo(config: DemoConfig) -> list[list[int]]:
    """Run the demo as ``paratrain demo`` does; returns the split of every batch."""
    config.check()
    devices = parse_devices_arg(config.devices) or default_demo_devices()
    return run_demo(devices, batch_size=config.batch_size, data_size=config.data_size, seed=config.seed)


class RandomDataset(Dataset[torch.Tensor]):
    """``length`` random vectors of ``size`` features, as in the tutorial."""

    def __init__(self, size: int, length: int, generator: torch.Generator | None = None) -> None:
        self.len = length
        self.data = torch.randn(length, size, generator=generator)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


def default_demo_devices() -> list[torch.device]:
    """Every visible GPU, or two CPU replicas when there is none."""
    return visible_gpus() or [torch.device("cpu")] * 2


def run_demo(
    devices: Sequence[torch.device],
    batch_size: int = 30,
    data_size: int = 100,
    input_size: int = 5,
    output_size: int = 2,
    seed: int = 0,
    log: Callable[[str], None] = print_line,
) -> list[list[int]]:
    """Run the demo; returns the split of every batch (samples per replica)."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        RandomDataset(input_size, data_size, generator),
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
    )
    torch.manual_seed(seed)
    inner = DemoModel(input_size, output_size, log=log)
    names = ", ".join(str(d) for d in devices)
    log(f"Let's use {len(devices)} devices: {names}")
    model = DataParallel(inner, device_ids=list(devices))
    model.to(devices[0])
    splits = []
    for i, data in enumerate(loader, start=1):
        input = data.to(devices[0])
        sizes = split_sizes(input.size(0), len(devices))
        splits.append(sizes)
        used = ", ".join(str(d) for d in devices[: len(sizes)])
        log(f"Batch {i}: {input.size(0)} samples split as {sizes} over {used}")
        output = model(input)
        log(f"Outside: input size {input.size()} output_size {output.size()}")
    model.close()
    return splits
