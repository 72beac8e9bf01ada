"""The tutorials' models, and a few bigger ones for benchmarks.

SimpleNet()          # the MNIST DataParallel tutorial's classifier: 784-256-10, ReLU
DemoModel(5, 2)      # the DataParallel tutorial's demo: Linear(5, 2) that prints its input and output sizes
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch import nn

from paratrain.errors import ConfigError

__all__ = ["MLP", "MODEL_NAMES", "DemoModel", "SimpleCNN", "SimpleNet", "build_model", "print_line"]


class SimpleNet(nn.Module):
    """The MNIST DataParallel tutorial's classifier: flatten, 784 -> 256, ReLU, 256 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)  # (batch, 784)
        logits: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))  # (batch, 10)
        return logits


_print_lock = threading.Lock()


def print_line(line: str) -> None:
    # replicas print from several threads at once; sys.stdout is not safe for concurrent writes
    with _print_lock:
        print(line, flush=True)


class DemoModel(nn.Module):
    """The DataParallel tutorial's demo model: one Linear layer that reports the sizes each replica sees."""

    def __init__(self, input_size: int = 5, output_size: int = 2, log: Callable[[str], None] = print_line) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)
        self.log = log

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.fc(input)
        self.log(f"\tIn Model: input size {input.size()} output size {output.size()}")
        return output


def _quiet(line: str) -> None:
    pass


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden layers of ``width`` with ReLU, then the classifier."""

    def __init__(self, in_features: int, num_classes: int, width: int = 1024, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class SimpleCNN(nn.Module):
    """A small conv net for (1, 28, 28) images: two conv + pool stages, then a linear classifier."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (16, 14, 14)
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (32, 7, 7)
        )
        self.classifier = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(torch.flatten(self.features(x), 1))
        return out


MODEL_NAMES = ("simplenet", "demo", "mlp", "cnn")


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, width: int = 1024, depth: int = 2
) -> nn.Module:
    """The model called ``name`` for samples of ``input_shape`` and ``num_classes`` classes.

    Raises:
        ConfigError: for an unknown name, or a model that cannot take the dataset's samples.
    """
    features = math.prod(input_shape)
    if name == "simplenet":
        _require(
            name,
            features == 784 and num_classes == 10,
            "784 inputs (28x28 images) and 10 classes",
            input_shape,
            num_classes,
            "use --model mlp or demo",
        )
        return SimpleNet()
    if name == "demo":
        _require(
            name,
            len(input_shape) == 1,
            "flat feature vectors such as (5,)",
            input_shape,
            num_classes,
            "use --dataset random, or --model mlp for images",
        )
        return DemoModel(input_shape[0], num_classes, log=_quiet)
    if name == "mlp":
        if width < 1 or depth < 0:
            raise ConfigError(f"mlp needs width >= 1 and depth >= 0; found width={width}, depth={depth}")
        return MLP(features, num_classes, width=width, depth=depth)
    if name == "cnn":
        _require(
            name,
            tuple(input_shape) == (1, 28, 28),
            "(1, 28, 28) images",
            input_shape,
            num_classes,
            "use --model mlp for other shapes",
        )
        return SimpleCNN(num_classes)
    raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")


def _require(name: str, ok: bool, expects: str, input_shape: tuple[int, ...], num_classes: int, advice: str) -> None:
    if not ok:
        raise ConfigError(
            f"model {name!r} takes {expects}, but the dataset has samples of shape {tuple(input_shape)} "
            f"and {num_classes} classes; {advice}"
        )
