"""The model a run starts from: the seed's weights, or ``--init-from``'s; under zero3 never whole on one rank.

    start = initial_model(build, config.init_from, "zero3", sample, input_shape=(784,), spec="mlp")
    model, optimizer, loader = par.prepare(start.model, optimizer, loader)
    said = start.fill(par, model)        # zero3: each rank copies its shards from the file, a tensor at a time

Under every strategy but zero3 the model is built plainly and the file loaded into it whole
(:func:`~paratrain.checkpoint.weights.load_weights`), before ``prepare``. Under zero3, with or without a file, it
is built on the meta device inside :func:`~paratrain.sharded.init_record.record_init`, and ``prepare`` replays
its construction unit by unit (every module's own initialisation, ``reset_parameters()`` or not, and any buffer,
in the state dict or not), drawing the random numbers a plain build draws in the same order: the run goes on
with the generator where a plain build leaves it and trains the same numbers as ddp. A file is opened first and
checked against the model's keys and shapes (the first that differs is the one error, before training, in every
process alike); after ``prepare`` each rank copies its part of every unit's flat shard from it, one tensor at a
time (:func:`~paratrain.checkpoint.lazy_weights.open_weights`): no rank ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.lazy_weights import WeightFile, open_weights
from paratrain.checkpoint.weights import check_fits_model, load_weights
from paratrain.sharded.init_record import InitRecord, record_init
from paratrain.training.fit import check_fits

__all__ = ["Start", "initial_model"]


@dataclass
class Start:
    """The model built, and the weights still to go into its shards (zero3 only)."""

    model: nn.Module
    source: str | None = None  # --init-from
    weights: WeightFile | None = None  # opened, to be read into the shards after prepare
    said: str | None = None  # where the weights came from, when they are in the model already
    record: InitRecord | None = None  # zero3: the model's construction on the meta device, for prepare to replay

    def fill(self, par: Any, prepared: nn.Module) -> str | None:
        """Copy this rank's shards from the file (zero3); the line saying where the weights came from."""
        if self.weights is None:
            return self.said
        try:
            par.strategy.load_model_state(prepared, self.weights.state)
        finally:
            self.weights.close()
        return f"Starting from the weights in {self.source} ({self.weights.what}, {self.weights.tensors} tensors)"


def initial_model(
    build: Callable[[], nn.Module],
    init_from: str | None,
    strategy: str,
    sample: torch.Tensor,
    *,
    input_shape: tuple[int, ...],
    spec: str,
) -> Start:
    """The model ``build`` makes, with ``init_from``'s weights in it (or ready to go into its shards: zero3).

    Raises:
        ConfigError: a model that does not take ``sample``; weights that do not fit the model (the first key or
            shape that differs), or none at ``init_from``.
    """
    if strategy == "zero3":  # on the meta device; prepare replays the construction unit by unit
        with record_init() as record:
            model = build()
        check_fits(model, sample.to("meta"), input_shape=input_shape, spec=spec, meta=True)
        if init_from is None:
            return Start(model, record=record)
        expected = model.state_dict()
        weights = open_weights(init_from, list(expected))
        try:
            check_fits_model(expected, weights.state, f"--init-from {init_from}")
        except Exception:
            weights.close()
            raise
        return Start(model, init_from, weights, record=record)
    model = build()
    check_fits(model, sample, input_shape=input_shape, spec=spec)
    if init_from is None:
        return Start(model)
    # into the plain model, before prepare, in every process
    read = load_weights(init_from, model)
    return Start(model, init_from, said=f"Starting from the weights in {init_from} ({read})")
