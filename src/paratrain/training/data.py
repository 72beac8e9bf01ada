"""What a dataset is once loaded: whole splits held as tensors, and where downloads go.

splits = load_dataset("digits")              # a DatasetSplits (paratrain.training.datasets)
splits.train.inputs.shape                    # (1437, 1, 28, 28): a TensorData
train = splits.train.to("cuda")
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.errors import ConfigError

__all__ = ["DatasetSplits", "TensorData", "default_cache_dir", "normalise", "parse_input_shape"]


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise; compare by identity
class TensorData:
    """A whole split held as tensors: ``inputs`` (N, ...) float32 and ``targets`` (N,) int64."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.targets.dim() != 1 or self.inputs.dim() < 1 or self.inputs.size(0) != self.targets.size(0):
            raise ConfigError(
                f"inputs of shape {tuple(self.inputs.shape)} and targets of shape {tuple(self.targets.shape)} do "
                f"not pair up; expected inputs (N, ...) and targets (N,) with the same N"
            )

    def __len__(self) -> int:
        return self.targets.size(0)

    def to(self, device: torch.device | str | int) -> TensorData:
        """Both tensors on ``device`` (the same object's tensors when they are already there)."""
        return TensorData(self.inputs.to(device), self.targets.to(device))


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise; compare by identity
class DatasetSplits:
    """A dataset's train and test splits, with what a model needs to know about it."""

    name: str
    train: TensorData
    test: TensorData
    num_classes: int
    input_shape: tuple[int, ...]  # one sample's shape, e.g. (1, 28, 28) or (5,)


def default_cache_dir() -> Path:
    """Where downloaded datasets go: ``$XDG_CACHE_HOME/paratrain``, or ``~/.cache/paratrain``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec says relative values are invalid and must be ignored
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "paratrain"


def normalise(pixels01: torch.Tensor) -> torch.Tensor:
    """torchvision's ``Normalize((0.5,), (0.5,))``: pixels in [0, 1] -> [-1, 1]."""
    return (pixels01 - 0.5) / 0.5


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``3,32,32`` -> (3, 32, 32).

    Raises:
        ConfigError: anything but comma-separated positive integers.
    """
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"--input-shape: expected positive integers separated by commas, such as 3,32,32; found {text!r}"
        )
    return tuple(int(p) for p in parts)
