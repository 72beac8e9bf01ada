"""Small models covering the shapes of computation DataParallel must get right."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.training.models import SimpleNet

Prediction = namedtuple("Prediction", ["logits", "hidden"])


@dataclass
class Features:
    x: torch.Tensor
    weight: torch.Tensor
    note: str = "features"


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):  # (batch, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(torch.flatten(x, 1))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):  # (batch, time, 6)
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class EmbeddingNet(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 5, sparse=sparse)
        self.fc = nn.Linear(5, 3)

    def forward(self, tokens):  # (batch, length) int64
        return self.fc(self.emb(tokens).mean(1))


class DictNet(nn.Module):
    """Takes a dict, returns a dict with a nested dict and a non-tensor leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, batch):
        logits = self.fc(batch["x"]) * batch["w"].unsqueeze(1)
        return {"logits": logits, "aux": {"norm": logits.norm(dim=1)}, "kind": "dict"}


class NamedTupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return Prediction(h * 2, h)


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, feats: Features):
        return Features(self.fc(feats.x) * feats.weight.unsqueeze(1), feats.weight, feats.note)


class KeywordOnlyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *, scale, mask=None, offset=0.0):
        out = self.fc(x) * scale + offset
        return out if mask is None else out * mask


class GradBufferNet(nn.Module):
    """A buffer that requires grad: it must receive gradients like a parameter would."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("temperature", torch.tensor([1.5, 0.5, 1.0], requires_grad=True))

    def forward(self, x):
        return self.fc(x) * self.temperature


class TanhNet(nn.Module):
    """Smooth, so a gradient penalty (double backward) is non-trivial."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


__all__ = [
    "ConvNet",
    "DataclassNet",
    "DictNet",
    "EmbeddingNet",
    "Features",
    "GradBufferNet",
    "KeywordOnlyNet",
    "LSTMNet",
    "NamedTupleNet",
    "Prediction",
    "SimpleNet",
    "TanhNet",
]
