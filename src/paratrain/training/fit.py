"""Does the model take the dataset's inputs? One forward on two samples, before training starts.

    check_fits(model, sample, input_shape=(1, 28, 28), spec="mynets:small")   # ConfigError naming the layer

A model built for other inputs fails deep inside its first layer ("mat1 and mat2 shapes cannot be multiplied
(2x784 and 100x10)"), after the data is loaded and the processes started. Run first on two samples, the layer that
fails is known: the error says what the dataset gives per sample and what that layer expects. The probe runs in
eval mode without gradients, with the random generators put back afterwards, so the run is the same with it.

On the meta device (``meta=True``: the launcher's check before ddp's workers start, with no memory spent) only a
layer whose input does not have the size it declares is reported; other failures are left to the real run,
since some operations have no meta implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from paratrain.errors import ConfigError

__all__ = ["check_fits"]


def check_fits(
    model: nn.Module, sample: torch.Tensor, *, input_shape: Sequence[int], spec: str, meta: bool = False
) -> None:
    """Run ``model`` on ``sample`` (a batch of the dataset's inputs); raise ConfigError when it cannot take them.

    Raises:
        ConfigError: a layer whose inputs do not have the size it declares (named, with what it expects and what
            the dataset gives), or (not ``meta``) any other failure of the forward pass, with its message.
    """
    entered: list[tuple[str, nn.Module, tuple[Any, ...]]] = []  # the modules running now, innermost last
    ran: list[nn.Module] = []  # every module that started, in order
    names = {id(m): name for name, m in model.named_modules()}

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        entered.append((names.get(id(module), "?"), module, args))
        ran.append(module)

    def post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        entered.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(sample)
    except Exception as exc:
        mismatch = _mismatch(entered[-1]) if entered else None
        where = f"the dataset gives inputs of shape {tuple(input_shape)} per sample"
        if mismatch is not None:
            name, expected, found = mismatch
            first = " (its first layer)" if _first_layer(ran) is entered[-1][1] else ""
            raise ConfigError(
                f"--model {spec} does not fit the data: {where}, but layer {name!r}{first} expects {expected}, and "
                f"got {found}. Build the model for inputs of shape {tuple(input_shape)}, or choose data of the "
                f"shape it takes (--dataset, or --input-shape for random inputs)"
            ) from exc
        if not meta:
            layer = f" in layer {entered[-1][0]!r}" if entered and entered[-1][0] else ""
            raise ConfigError(
                f"--model {spec} cannot run on the data: {where}, and its forward pass on 2 of them raised "
                f"{type(exc).__name__}{layer}: {_first_line(exc)}"
            ) from exc
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def _mismatch(frame: tuple[str, nn.Module, tuple[Any, ...]]) -> tuple[str, str, str] | None:
    """(layer name, what it expects, what it got) when ``frame``'s module got an input of the wrong size."""
    name, module, args = frame
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if x is None:
        return None
    shape = tuple(x.shape)
    if isinstance(module, nn.Linear) and (x.dim() == 0 or x.shape[-1] != module.in_features):
        return (
            name,
            f"{module.in_features} features per sample (Linear({module.in_features}, {module.out_features}))",
            f"a batch of shape {shape}, {shape[-1] if shape else 0} features per sample",
        )
    if isinstance(module, _ConvNd):
        dims = len(module.kernel_size)
        if x.dim() in (dims + 1, dims + 2) and x.shape[-dims - 1] != module.in_channels:
            return (
                name,
                f"{module.in_channels} input channels ({type(module).__name__}({module.in_channels}, "
                f"{module.out_channels}, ...))",
                f"a batch of shape {shape}, {x.shape[-dims - 1]} channel(s)",
            )
        if x.dim() not in (dims + 1, dims + 2):
            return (name, f"inputs of {dims + 2} dimensions (batch, channels, ...)", f"a batch of shape {shape}")
    return None


def _first_layer(ran: list[nn.Module]) -> nn.Module | None:
    """The first module to run that holds parameters of its own."""
    return next((m for m in ran if next(m.parameters(recurse=False), None) is not None), None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
