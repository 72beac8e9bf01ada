"""A model built on the meta device, materialised unit by unit: each rank keeps its shards, never the whole model.

    torch.manual_seed(0)                                  # the same seed in every process
    with torch.device("meta"):
        model = build()                                   # no memory: shapes only
    units = materialize_units(model, plan_units(model), device, rank, world_size)

The weights are those a plain build with the same seed gives: the modules are visited in registration order (the
order a model's constructor builds them in, and so draws its random numbers in) and each module's own parameters
and buffers are given storage in its unit's flat buffer and initialised by the module's ``reset_parameters()``,
as its constructor did. A unit's buffer exists from its first module to its last; then the rank keeps its part and
releases the rest. A module that owns parameters or buffers but has no ``reset_parameters`` cannot be
re-initialised and is refused; so is a model whose ranks did not draw the same weights (seed every process alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.process_groups import keep_forever, wait_work
from paratrain.errors import ConfigError, DistributedError
from paratrain.sharded.flat_unit import ShardedUnit
from paratrain.sharded.init_record import InitRecord, find_record, storage_key
from paratrain.sharded.units import UnitPlan

__all__ = ["check_same_everywhere", "materialize_units"]


def _own(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )


def _replace_parameters(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Every meta parameter replaced in its modules by one on ``device`` (a meta tensor cannot move in place); tied
    ones stay tied. Returns the new parameters by the old ones' ``id``."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = replaced.get(id(p))
            if new is None:
                resting = torch.full((), float("nan"), dtype=p.dtype, device=device).expand(p.shape)
                new = replaced[id(p)] = nn.Parameter(resting, requires_grad=p.requires_grad)
            module._parameters[name] = new
    return replaced


def materialize_units(
    model: nn.Module, plan: Sequence[UnitPlan], device: torch.device, rank: int, world_size: int
) -> tuple[list[ShardedUnit], dict[int, nn.Parameter]]:
    """The units of ``plan`` with their weights initialised on ``device`` (module docstring); their shards kept.

    The model's meta parameters are replaced by new ones (an optimizer built over the old ones is pointed at the
    new ones by :meth:`paratrain.strategies.fully_sharded.Zero3Strategy.wrap_optimizer`); returns the units and the
    new parameters by the old ones' ``id``.

    A model built under :func:`paratrain.sharded.init_record.record_init` (``Parallel.init_module()``) is
    materialised by replaying its construction instead (:func:`materialize_recorded`): any initialisation the
    script ran, ``reset_parameters()`` or not.

    Raises:
        ConfigError: a module owning parameters or buffers without ``reset_parameters()``.
    """
    record = find_record([t for t in (*model.parameters(), *model.buffers()) if t.is_meta])
    if record is not None:
        return materialize_recorded(model, plan, record, device, rank, world_size)
    modules = [(name, m) for name, m in model.named_modules() if _own(m)]
    missing = [name or "(the root)" for name, m in modules if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ConfigError(
            f"a model built on the meta device is initialised module by module with reset_parameters(), which "
            f"{', '.join(missing[:6])} do{'es' * (len(missing) == 1)} not have: give those modules a "
            f"reset_parameters() that initialises their own parameters and buffers, or build the model on a real "
            f"device"
        )
    replaced = _replace_parameters(model, device)
    plan = [dataclasses.replace(unit, params=tuple(replaced.get(id(p), p) for p in unit.params)) for unit in plan]
    unit_of = {id(p): k for k, unit in enumerate(plan) for p in unit.params}
    last: dict[int, int] = {}  # a unit -> the position of the last module whose parameters it holds
    for at, (_, module) in enumerate(modules):
        for p in module._parameters.values():
            if p is not None:
                last[unit_of[id(p)]] = at
    units: dict[int, ShardedUnit] = {}
    done: list[ShardedUnit | None] = [None] * len(plan)
    for at, (_, module) in enumerate(modules):
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
        for p in module._parameters.values():
            if p is None:
                continue
            k = unit_of[id(p)]
            if k not in units:
                if done[k] is not None:
                    raise ConfigError(f"internal: unit {plan[k].name!r} was released before its last module")
                unit = ShardedUnit(k, plan[k], rank, world_size, device=device)
                unit.use()
                units[k] = unit
        with torch.no_grad():
            module.reset_parameters()  # type: ignore[operator]
        for k in [k for k, end in last.items() if end == at and k in units]:
            unit = units.pop(k)
            unit.keep_own_part()
            unit.checksum = float(unit.full.double().sum())
            unit.free()
            done[k] = unit
    return [unit for unit in done if unit is not None], replaced


def materialize_recorded(
    model: nn.Module, plan: Sequence[UnitPlan], record: InitRecord, device: torch.device, rank: int, world_size: int
) -> tuple[list[ShardedUnit], dict[int, nn.Parameter]]:
    """:func:`materialize_units` for a model whose construction ``record`` holds: the construction replayed on
    ``device`` one storage at a time, each parameter's final value copied into this rank's part of its unit's
    shard as soon as it is known (no unit's whole buffer is ever allocated beyond its construction), each buffer
    kept whole."""
    where: dict[int, nn.Parameter] = {}  # a parameter (the new one, by id) -> the meta one it replaces
    for p in model.parameters():
        if p.is_meta:
            where[id(p)] = p
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None and b.is_meta]
    replaced = _replace_parameters(model, device)
    meta_of = {id(new): where[old] for old, new in replaced.items()}
    plan = [dataclasses.replace(unit, params=tuple(replaced.get(id(p), p) for p in unit.params)) for unit in plan]
    units = []
    for k, unit_plan in enumerate(plan):
        unit = ShardedUnit(k, unit_plan, rank, world_size, device=device)
        unit.free()  # the construction's zeros: this rank's part is written below, parameter by parameter
        units.append(unit)
    slots: dict[int, list[tuple[ShardedUnit, int]]] = {}  # a storage -> the unit parameters that view it
    for unit in units:
        for i, p in enumerate(unit.params):
            slots.setdefault(storage_key(meta_of[id(p)]), []).append((unit, i))
    wanted: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    for module, name, b in buffers:
        wanted.setdefault(storage_key(b), []).append((module, name, b))
    sums = [0.0] * len(units)
    written: set[tuple[int, int]] = set()

    def finalize(key: int, flat: torch.Tensor) -> None:
        for unit, i in slots.get(key, []):
            meta = meta_of[id(unit.params[i])]
            value = flat.as_strided(meta.shape, meta.stride(), meta.storage_offset()).reshape(-1)
            start, end = unit.offsets[i], unit.offsets[i] + value.numel()
            mine = unit.rank * unit.part
            low, high = max(start, mine), min(end, mine + unit.part)
            if low < high:
                unit.shard[low - mine : high - mine].copy_(value[low - start : high - start])
            sums[unit.index] += float(value.double().sum())
            written.add((unit.index, i))
        for module, name, b in wanted.get(key, []):
            module._buffers[name] = flat.as_strided(b.shape, b.stride(), b.storage_offset()).clone()

    record.replay(device, finalize)
    missing = [u.names[i] for u in units for i in range(len(u.params)) if (u.index, i) not in written]
    if missing:
        raise ConfigError(
            f"the model's construction, replayed, never made the parameters {missing[:6]}: build the model inside "
            f"Parallel.init_module() (all of it), or on a real device"
        )
    for unit, total in zip(units, sums, strict=True):
        unit.checksum = total
    return units, replaced


def check_same_everywhere(units: Sequence[ShardedUnit], group: object, device: torch.device) -> None:
    """Raise DistributedError unless every rank drew the same weights (the checksums of the whole units agree)."""
    world_size = dist.get_world_size(group)  # type: ignore[arg-type]
    if world_size == 1 or not units:
        return
    mine = torch.tensor([u.checksum for u in units], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)  # type: ignore[arg-type]
    wait_work(work, None)
    differ = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
    if differ:
        keep_forever(work)  # the user may exit a moment after it completed (see paratrain.comm.process_groups)
        raise DistributedError(
            f"the model built on the meta device was initialised differently on ranks {differ} than on rank 0: "
            f"each rank keeps only its shard of the weights, so every process must draw the same ones. Seed every "
            f"process alike before building the model (Parallel(seed=...) or torch.manual_seed)"
        )
