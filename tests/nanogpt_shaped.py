"""nanoGPT's model as its train.py builds it, shrunk: a LayerNorm of its own (no ``reset_parameters``), the head
tied to the token embedding, ``self.apply(self._init_weights)`` after construction and the residual projections
drawn again with a scaled std. What a meta-device build must replay to give a plain build's weights."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, CONTEXT, LAYERS = 96, 64, 8, 3


class LayerNorm(nn.Module):
    """nanoGPT's: weight and an optional bias, made by torch.ones and torch.zeros."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = LayerNorm(WIDTH, bias=True)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(CONTEXT, WIDTH),
                "h": nn.ModuleList([Block() for _ in range(LAYERS)]),
                "ln_f": LayerNorm(WIDTH, bias=False),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.transformer.ln_f(x))
        return logits
