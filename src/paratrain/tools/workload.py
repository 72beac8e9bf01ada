"""What one run of ``verify``/``bench``/``plan`` trains: the model, the data, the loss and the optimizer.

Built from :class:`~paratrain.tools.settings.RunSettings` the same way in every process, so that every
configuration (and every rank of a ddp one) starts from the same weights and sees the same global batches::

    work = Workload.load(settings)
    model = work.build_model()            # seeded by settings.seed
    optimizer = build_optimizer(settings, model.parameters())
    for x, y in endless(par.prepare(work.loader())): ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.loop.prepared import PreparedIndexedLoader
from paratrain.parallel import seed_everything
from paratrain.tools.settings import RunSettings
from paratrain.training.data import TensorData, parse_input_shape
from paratrain.training.datasets import load_dataset
from paratrain.training.loader import DeviceLoader
from paratrain.training.model_spec import build_model_spec
from paratrain.training.optimizers import build_optimizer as training_optimizer

__all__ = ["Workload", "build_optimizer", "endless"]

_RANDOM_BATCHES = 4  # random data: this many global batches of samples, cycled


def build_optimizer(settings: RunSettings, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The run's optimizer, built from the same settings as ``paratrain train`` builds it."""
    return training_optimizer(
        params,
        settings.optimizer,
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        betas=settings.betas,
    )


@dataclass(frozen=True)
class Workload:
    settings: RunSettings
    data: TensorData
    input_shape: tuple[int, ...]
    num_classes: int

    @classmethod
    def load(cls, settings: RunSettings) -> Workload:
        """The data the settings name: a built-in dataset's training split, or seeded random tensors."""
        shape = parse_input_shape(settings.input_shape) if settings.input_shape is not None else None
        splits = load_dataset(
            settings.dataset_name,
            settings.data_dir,
            verify=settings.verify_data,
            input_shape=shape,
            num_classes=settings.num_classes,
            samples=settings.batch_size * _RANDOM_BATCHES,
            seed=settings.seed,
        )
        return cls(settings, splits.train, splits.input_shape, splits.num_classes)

    def build_model(self) -> nn.Module:
        """The model, with weights drawn from ``settings.seed`` (the same in every process)."""
        s = self.settings
        seed_everything(s.seed)
        return build_model_spec(s.model, self.input_shape, self.num_classes, width=s.width, depth=s.depth)

    def loader(self, batch_size: int | None = None) -> DeviceLoader:
        """Shuffled global batches of ``batch_size`` (default the settings'); every batch full when possible."""
        size = batch_size or self.settings.batch_size
        return DeviceLoader(self.data, size, shuffle=True, seed=self.settings.seed, drop_last=len(self.data) >= size)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the model's logits, reduced as ``settings.loss`` says."""
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"the model returned a {type(output).__name__}; verify/bench/plan expect logits of shape "
                f"(batch, num_classes) for a cross-entropy loss"
            )
        return F.cross_entropy(output, targets, reduction=self.settings.loss)

    def sample_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``size`` samples (repeated when the data has fewer)."""
        index = torch.arange(size) % len(self.data)
        return self.data.inputs[index], self.data.targets[index]


def endless(loader: PreparedIndexedLoader | DeviceLoader) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1
