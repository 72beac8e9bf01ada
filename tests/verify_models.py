"""Small models for `paratrain verify` tests, each given as `verify_models:NAME` (tests/ is on sys.path).

Every factory takes (input_shape, num_classes); `clean_net` has nothing that makes parallel runs differ, each
of the others has exactly one recognised cause.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn

_UNSEEDED = np.random.default_rng()  # no seed_everything reaches it, and copies of a model share it


def _features(input_shape: tuple[int, ...]) -> int:
    return math.prod(input_shape)


def clean_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(_features(input_shape), 16), nn.Tanh(), nn.Linear(16, num_classes))


class BatchNormNet(nn.Module):
    """Registered head first, but forward runs body -> norm -> head: the forward order is not the registration order."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(16, num_classes)
        self.norm = nn.BatchNorm1d(16)
        self.body = nn.Linear(features, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x.flatten(1)))))


def batchnorm_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return BatchNormNet(_features(input_shape), num_classes)


class DropoutNet(nn.Module):
    """nn.Dropout on a learned per-feature gain: one mask per forward, whatever the batch, so every device draws
    its own mask and at most one of them can be the one device's (per-sample masks could line up by chance when
    CPU replicas happen to draw in order from the shared generator)."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, 16)
        self.gain = nn.Parameter(torch.ones(16))
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))) * self.drop(self.gain))


def dropout_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return DropoutNet(_features(input_shape), num_classes)


class NoisyNet(nn.Module):
    """Random numbers in forward without a Dropout layer (torch's seeded generator): one noise vector per forward."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.fc(x + torch.randn(x.shape[1]))


def noisy_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return NoisyNet(_features(input_shape), num_classes)


class UnseededNet(nn.Module):
    """Forward that differs run to run under the same seed, as non-deterministic kernels do."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        noise = torch.from_numpy(_UNSEEDED.standard_normal(x.shape).astype(np.float32))
        return self.fc(x + 1e-3 * noise)


def unseeded_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return UnseededNet(_features(input_shape), num_classes)


def no_arguments() -> nn.Module:
    return nn.Linear(6, 3)


def raises(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    raise RuntimeError("cannot build this one")


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> object:
    return "a string"


class PickyNet(nn.Module):
    """Works on the whole batch of 12 only: a configuration that splits the batch fails to run."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 12:
            raise ValueError(f"PickyNet wants 12 samples, got {x.shape[0]}")
        return self.fc(x.flatten(1))


def picky_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return PickyNet(_features(input_shape), num_classes)


def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A clean small CNN: Conv2d, ReLU, adaptive pooling, Linear (nothing that makes parallel runs differ)."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def wrong_shape(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model for 100 input features, whatever the data gives (28x28 images give 784)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(100, num_classes))


def wrong_channels(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model for 3-channel images, whatever the data gives."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))


class _Sleeper(nn.Module):
    """A linear model whose forward also waits: what a busy machine does to a step, made repeatable."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, num_classes)
        self.calls = 0

    def wait(self, batch: int) -> float:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.requires_grad or torch.is_grad_enabled():
            time.sleep(self.wait(x.shape[0]))
        return self.fc(x.flatten(1))


class _SlowsDown(_Sleeper):
    def wait(self, batch: int) -> float:
        return 0.0 if self.calls <= 8 else 0.01  # quiet, then busy: the measurements move between repeats


class _Superlinear(_Sleeper):
    def wait(self, batch: int) -> float:
        return (batch / 30) ** 3  # half the batch in an eighth of the time: N devices look over N times faster


def slows_down(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return _SlowsDown(_features(input_shape), num_classes)


def superlinear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return _Superlinear(_features(input_shape), num_classes)
