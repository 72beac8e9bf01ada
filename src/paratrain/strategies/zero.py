"""``zero1`` and ``zero2``: one process per device as under ddp, with the training state sharded across them.

``zero1`` shards the optimizer state (each rank updates its part of every bucket, then all-gathers the weights);
``zero2`` shards the gradients too (each bucket is reduce-scattered during backward). A loop runs unchanged::

    par = Parallel("zero2")                               # in a process started by paratrain launch / torchrun
    model, optimizer, loader = par.prepare(model, optimizer, loader)    # optimizer: same class, this rank's shard
    ...
    par.save({"model": model, "optimizer": optimizer, "step": step}, "runs/a/step-100.pt")   # a sharded checkpoint

The model must be prepared before (or in the same call as) its optimizer. See :mod:`paratrain.sharded.zero`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from paratrain.checkpoint.sharded import Alias, LocalSlices
from paratrain.checkpoint.state_dicts import parameter_keys
from paratrain.ddp.options import Refusal
from paratrain.sharded.zero import ZeroDataParallel
from paratrain.strategies.sharded import ShardedStrategy

__all__ = ["Zero1Strategy", "Zero2Strategy", "ZeroStrategy"]


class ZeroStrategy(ShardedStrategy):
    """Sharded data parallel across processes (see the module docstring); ``stage`` says what is sharded."""

    name: ClassVar[str] = "zero"
    stage: ClassVar[int] = 0

    def _wrap(self, model: nn.Module) -> nn.Module:
        return self._adopt(ZeroDataParallel(model.to(self._device), self.stage, **self._wrapper_args()))

    def describe(self) -> str:
        return f"{self.name}, {self.world_size} processes, on {self._device.type}"

    def wrappers(self) -> list[ZeroDataParallel]:
        return [w for w in self._ddp if isinstance(w, ZeroDataParallel)]

    @staticmethod
    def trained(wrapper: ZeroDataParallel) -> list[torch.nn.Parameter]:
        return list(wrapper.reducer.params)

    def wrapper_of(self, model: nn.Module, what: str) -> ZeroDataParallel:
        found: ZeroDataParallel = super().wrapper_of(model, what)
        return found

    # -- the whole gradient, for checks -----------------------------------------------------------------------

    def gradients(self, model: nn.Module) -> list[torch.Tensor | None]:
        wrapper = self.wrapper_of(model, "gradients()")
        whole = dict(zip((id(p) for p in wrapper.reducer.params), wrapper.full_gradients(), strict=True))
        return [whole.get(id(p), p.grad) for p in wrapper.module.parameters()]

    # -- checkpoints: every rank its own slices ---------------------------------------------------------------

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's state dict with every bucketed parameter as this rank's slices of it, found by name.

        A tied parameter is sliced under its first name; its other keys are :class:`Alias` es of that one. A key
        whose value is not the parameter's data (a state-dict hook replaced it) is saved as it is, by rank 0.
        """
        wrapper = self.wrapper_of(model, "saving the model")
        mine: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for piece in wrapper.owned_pieces():
            mine.setdefault(id(piece.param), []).append((piece.start, piece.value))
        state = wrapper.module.state_dict()
        values = dict(state)  # as state_dict() gave them, while state's are replaced
        keys = parameter_keys(wrapper.module, (p for p in wrapper.reducer.params if p.numel()))
        for key, (first, p) in keys.items():
            if not (_holds(values.get(key), p) and _holds(values.get(first), p)):
                continue
            if key == first:
                state[key] = LocalSlices(tuple(p.shape), p.dtype, list(mine.get(id(p), [])))
            else:
                state[key] = Alias(first)
        return state


def _holds(value: Any, param: torch.Tensor) -> bool:
    """Whether a state dict's ``value`` is ``param``'s data (``state_dict()`` gives it detached, not a copy)."""
    return (
        isinstance(value, torch.Tensor)
        and value.shape == param.shape
        and value.dtype == param.dtype
        and value.data_ptr() == param.data_ptr()
    )


class Zero1Strategy(ZeroStrategy):
    """``zero1``: the optimizer state sharded; gradients all-reduced as under ddp.

    Of :class:`~paratrain.ddp.options.DDPOptions` it honours all but ``gradient_as_bucket_view=False``.
    """

    name: ClassVar[str] = "zero1"
    stage: ClassVar[int] = 1
    refused_options: ClassVar[dict[str, Refusal]] = {
        "gradient_as_bucket_view": Refusal(
            "zero1's gradients are views of its buckets, which its sharded optimizer reads (a copy in .grad "
            "would only cost memory)",
            "drop gradient_as_bucket_view, or use strategy ddp for gradients of their own",
        ),
    }


class Zero2Strategy(ZeroStrategy):
    """``zero2``: the optimizer state and the gradients sharded; gradients reduce-scattered during backward.

    Of :class:`~paratrain.ddp.options.DDPOptions` it honours ``find_unused_parameters``, ``static_graph`` and
    ``bucket_cap_mb``, and refuses the rest.
    """

    name: ClassVar[str] = "zero2"
    stage: ClassVar[int] = 2
    refused_options: ClassVar[dict[str, Refusal]] = {
        "gradient_as_bucket_view": Refusal(
            "zero2 keeps no whole gradient to view: each bucket is reduce-scattered during backward and this rank "
            "keeps its part only",
            "drop gradient_as_bucket_view, or use strategy ddp for whole gradients in .grad",
        ),
        "comm_hook": Refusal(
            "its gradients are reduce-scattered, and a hook replaces an all-reduce",
            "use strategy ddp or zero1 for a hook, or drop the hook",
        ),
    }
