"""The seeds' models, and a few bigger ones for benchmarks.

SimpleNet()          # the second seed: 784-256-10, ReLU
DemoModel(5, 2)      # the first seed: Linear(5, 2) that prints its input and output sizes
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["DemoModel", "SimpleNet", "print_line"]


class SimpleNet(nn.Module):
    """The second seed's classifier: flatten, 784 -> 256, ReLU, 256 -> 10."""

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
    """The first seed's model: one Linear layer that reports the sizes each replica sees."""

    def __init__(self, input_size: int = 5, output_size: int = 2, log: Callable[[str], None] = print_line) -> None:
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)
        self.log = log

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.fc(input)
        self.log(f"\tIn Model: input size {input.size()} output size {output.size()}")
        return output
