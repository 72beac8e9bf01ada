"""Replicas of a module whose gradients flow back to the original parameters.

A replica is a shallow twin of each submodule whose parameters are *differentiable copies* of the originals
(``param.to(device)``; on the original's own device the original tensor itself), so the backward pass of every
replica accumulates into the one set of ``.grad`` tensors. Buffers are copied per replica, so replicas that
update them in forward (BatchNorm's running statistics) do not race; :meth:`ReplicaSet.sync_buffers` then
adds the sample-weighted mean of the replicas' updates to the original.

Replica module objects are built once per :class:`Replicator` and reused while the module's structure (its
submodules, parameter objects and buffer names) is unchanged; each call refreshes only the replicas'
attributes and tensors.

    replicator = Replicator(model, [torch.device("cpu")] * 3)
    replicas = replicator.replicate([0, 1, 2])     # a ReplicaSet
    outs = [r(x) for r, x in zip(replicas.modules, chunks)]
    replicas.sync_buffers(weights=[10 / 30] * 3)
    replicas.release()
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from paratrain.errors import ConfigError

__all__ = ["BufferMode", "ReplicaSet", "Replicator", "replicate"]

BufferMode = Literal["mean", "first"]
BUFFER_MODES: tuple[str, ...] = ("mean", "first")

_PLAIN_SETATTR = nn.Module.__setattr__
_PLAIN_REPLICATE = nn.Module._replicate_for_data_parallel


def _structure_key(modules: Sequence[nn.Module]) -> tuple[Any, ...]:
    """What must stay the same for built replicas to be reused: module objects, parameter objects, names."""
    return tuple(
        (
            id(m),
            tuple((name, id(p)) for name, p in m._parameters.items()),
            tuple(m._buffers),
            tuple((name, id(c)) for name, c in m._modules.items()),
        )
        for m in modules
    )


@dataclass
class _Plan:
    """The replica objects for one module structure, and where each tensor goes in them."""

    key: tuple[Any, ...]
    modules: list[nn.Module]  # the originals, deduplicated, in modules() order
    shells: list[list[nn.Module]]  # shells[replica][module]
    children: list[list[dict[str, nn.Module | None]]]  # the _modules dict of each shell
    param_refs: list[tuple[int, str]]  # where each distinct parameter lives in the original
    param_slots: list[tuple[int, str, int]]  # (module, name, distinct parameter) for every parameter slot
    buffer_slots: list[tuple[int, str]]
    plain_setattr: list[bool]  # per module: is it safe to write tensors straight into __dict__
    own_replicate: list[bool]  # per module: does its class customise _replicate_for_data_parallel


def _build_plan(key: tuple[Any, ...], modules: list[nn.Module], num_replicas: int) -> _Plan:
    for m in modules:
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and is_lazy(t):
                raise ConfigError(
                    f"cannot replicate {type(m).__name__}: its tensor {name!r} is uninitialized (a lazy "
                    f"module); run one forward pass on a single device to initialize it, then wrap the module"
                )
    index = {id(m): i for i, m in enumerate(modules)}
    shells = [[type(m).__new__(type(m)) for m in modules] for _ in range(num_replicas)]
    children = [
        [{name: (row[index[id(c)]] if c is not None else None) for name, c in m._modules.items()} for m in modules]
        for row in shells
    ]
    param_refs: list[tuple[int, str]] = []
    param_slots: list[tuple[int, str, int]] = []
    seen: dict[int, int] = {}
    buffer_slots: list[tuple[int, str]] = []
    for mi, m in enumerate(modules):
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) not in seen:  # tied weights: one copy per device, shared by every slot
                seen[id(p)] = len(param_refs)
                param_refs.append((mi, name))
            param_slots.append((mi, name, seen[id(p)]))
        buffer_slots.extend((mi, name) for name in m._buffers)
    return _Plan(
        key=key,
        modules=modules,
        shells=shells,
        children=children,
        param_refs=param_refs,
        param_slots=param_slots,
        buffer_slots=buffer_slots,
        plain_setattr=[type(m).__setattr__ is _PLAIN_SETATTR for m in modules],
        own_replicate=[type(m)._replicate_for_data_parallel is not _PLAIN_REPLICATE for m in modules],
    )


@dataclass
class ReplicaSet:
    """The replicas of one forward call; collects their buffer updates afterwards."""

    plan: _Plan
    rows: list[int]  # which shells row each replica uses
    devices: list[torch.device]

    @property
    def modules(self) -> list[nn.Module]:
        """The replica root modules, one per device."""
        return [self.plan.shells[row][0] for row in self.rows]

    def sync_buffers(self, weights: Sequence[float], mode: BufferMode = "mean") -> None:
        """Write the replicas' buffer updates back to the original module.

        ``mean`` adds the ``weights``-weighted mean of the replicas' changes to each buffer (weights are each
        replica's share of the batch, so BatchNorm's running mean gets exactly the whole batch's update, and
        counters such as ``num_batches_tracked`` advance once). A buffer no replica changed keeps its exact
        value, ``inf`` included. ``first`` keeps replica 0's value, as ``torch.nn.DataParallel`` does.
        Buffers are merged in flat groups per device and dtype: a few kernels per replica, no host sync.
        """
        plan = self.plan
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
        seen: set[int] = set()
        for mi, name in plan.buffer_slots:
            module = plan.modules[mi]
            original = module._buffers.get(name)
            if original is None or id(original) in seen:
                continue
            seen.add(id(original))
            current = [plan.shells[row][mi]._buffers.get(name) for row in self.rows]
            usable = [t for t in current if t is not None and t.shape == original.shape and t.dtype == original.dtype]
            if len(usable) != len(current):
                _replace_buffer(module, name, original, current)
                continue
            groups.setdefault((original.device, original.dtype), []).append((original, usable))
        for items in groups.values():
            _merge_group(
                [o for o, _ in items], [list(c) for c in zip(*(cur for _, cur in items), strict=True)], weights, mode
            )

    def release(self) -> None:
        """Drop the replicas' references to tensors, so nothing outlives the step but the autograd graph."""
        plan = self.plan
        for row in self.rows:
            shells = plan.shells[row]
            for mi, name, _ in plan.param_slots:
                _set_tensor(shells[mi], name, None, plan.plain_setattr[mi])
            for shell in shells:
                shell.__dict__["_buffers"] = {}


def _flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)
    return flat.to(device)


def _merge_group(
    originals: list[torch.Tensor],
    per_replica: list[list[torch.Tensor]],
    weights: Sequence[float],
    mode: BufferMode,
) -> None:
    """Merge same-dtype buffers of every replica into the originals, as one flat tensor."""
    device = originals[0].device
    with torch.no_grad():
        base = _flat(originals, device).clone()
        if mode == "first" or base.dtype == torch.bool or len(per_replica) == 1:
            new = _flat(per_replica[0], device)
        else:
            floating = base.is_floating_point() or base.is_complex()
            acc = torch.zeros_like(base, dtype=base.dtype if floating else torch.float64)
            for w, buffers in zip(weights, per_replica, strict=True):
                flat = _flat(buffers, device)
                if floating:  # where(): an unchanged inf gives a change of 0, not inf - inf = nan
                    delta = torch.where(flat == base, torch.zeros_like(flat), flat - base)
                else:
                    delta = (flat - base).double()
                acc.add_(delta, alpha=w)
            new = base + acc if floating else base + acc.round().to(base.dtype)
        pieces = [
            piece.view_as(o) for piece, o in zip(new.split([o.numel() for o in originals]), originals, strict=True)
        ]
        torch._foreach_copy_(originals, pieces)


def _replace_buffer(module: nn.Module, name: str, original: torch.Tensor, current: list[torch.Tensor | None]) -> None:
    """A replica replaced the buffer with another shape or dtype: nothing to average; keep replica 0's."""
    first = current[0]
    if first is None:
        return
    shapes = [None if t is None else tuple(t.shape) for t in current]
    warnings.warn(
        f"buffer {type(module).__name__}.{name} came back from the replicas with shapes {shapes} instead of "
        f"{tuple(original.shape)}; it cannot be averaged, so replica 0's value is kept",
        stacklevel=4,
    )
    module._buffers[name] = first.detach().to(original.device)


def _set_tensor(shell: nn.Module, name: str, value: torch.Tensor | None, plain: bool) -> None:
    if plain:
        shell.__dict__[name] = value
    else:  # e.g. RNNs keep _flat_weights in step with attribute writes
        setattr(shell, name, value)


class Replicator:
    """Makes replicas of ``module`` on fixed ``devices``, reusing the replica objects between calls.

    Args:
        module: the original module; it must already live on the device its parameters should stay on.
        devices: the device of each replica slot (repeats allowed: several replicas on one device).
        share_same_device: on the original's device, hand the original parameters to the replica instead of
            a copy (the fast path). ``False`` copies them there too, which exercises the cross-device
            gradient path on a CPU-only machine.
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], *, share_same_device: bool = True) -> None:
        self.module = module
        self.devices = list(devices)
        self.share_same_device = share_same_device
        self._builds = 0  # how often replica objects were (re)built: private, kept so tests can prove reuse
        self._plan: _Plan | None = None

    def replicate(self, slots: Sequence[int] | None = None) -> ReplicaSet:
        """Replicas for the given device slots (default: all), their tensors refreshed from the module."""
        rows = list(range(len(self.devices))) if slots is None else list(slots)
        modules = list(self.module.modules())
        key = _structure_key(modules)
        if self._plan is None or self._plan.key != key:
            self._plan = _build_plan(key, modules, len(self.devices))
            self._builds += 1
        plan = self._plan
        devices = [self.devices[row] for row in rows]
        params: list[torch.Tensor] = [plan.modules[mi]._parameters[name] for mi, name in plan.param_refs]  # type: ignore[misc]
        buffers = [plan.modules[mi]._buffers[name] for mi, name in plan.buffer_slots]
        replicas = ReplicaSet(plan, rows, devices)
        for row, device in zip(rows, devices, strict=True):
            shells = plan.shells[row]
            for mi, (original, shell) in enumerate(zip(plan.modules, shells, strict=True)):
                _refresh_shell(shell, original, plan.children[row][mi], plan.own_replicate[mi])
            copies = [self._param_copy(p, device) for p in params]
            for mi, name, ui in plan.param_slots:
                _set_tensor(shells[mi], name, copies[ui], plan.plain_setattr[mi])
            # every replica gets its own buffers: updates in forward must not race, and the originals
            # stay as they were so sync_buffers can tell each replica's change
            seen: dict[int, torch.Tensor] = {}
            for (mi, name), b in zip(plan.buffer_slots, buffers, strict=True):
                copy = None
                if b is not None:
                    copy = seen.get(id(b))
                    if copy is None:
                        copy = seen[id(b)] = b.to(device, copy=True)
                shells[mi]._buffers[name] = copy
        return replicas

    def _param_copy(self, p: torch.Tensor, device: torch.device) -> torch.Tensor:
        if p.device == device and self.share_same_device:
            return p
        # differentiable: the backward of .to() sends each replica's gradient back to the original
        return p.to(device, non_blocking=True, copy=True)


def _refresh_shell(
    shell: nn.Module, original: nn.Module, children: dict[str, nn.Module | None], own_replicate: bool
) -> None:
    state = shell.__dict__
    # plain attributes (training, hooks, user settings) follow the original on every call
    state.update(original.__dict__)
    if own_replicate:  # the module's own replication hook (RNNs copy their _flat_weights list there)
        state.update(original._replicate_for_data_parallel().__dict__)
    # a parameter registered as None (Linear(bias=False)'s bias) stays None: forward reads it
    state["_parameters"] = {name: None for name, p in original._parameters.items() if p is None}
    state["_buffers"] = {}
    state["_modules"] = children
    state["_is_replica"] = True


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Fresh replicas of ``module`` on ``devices``, built from scratch (no reuse between calls)."""
    return Replicator(module, devices).replicate().modules
