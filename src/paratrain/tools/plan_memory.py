"""``paratrain plan``'s memory per device: what ddp, zero1, zero2 and zero3 hold of the model's state at each N.

    rows = memory_rows(model, "adamw", momentum=0.0, world_sizes=range(1, 9), activations={1: ..., 2: ...})
    smallest_fit(rows, 80e9)        # {"ddp": 4, "zero1": 2, "zero2": 2}: the fewest devices each fits on

Model states are counted exactly as the strategies allocate them, from the same buckets and partition
(:mod:`paratrain.ddp.buckets`, :mod:`paratrain.sharded.partition`), for the rank holding the most (rank 0):

- parameters: whole on every rank (zero1, zero2: each bucket padded to N equal parts);
- gradients: every bucket (ddp and zero1 keep them as the buckets' buffers), or zero2's part of each;
- optimizer state: its per-element tensors over the elements the rank updates (all of them under ddp), and
  each updated tensor's step count;
- zero2 also holds the two largest buckets' bytes while backward runs ("in flight"): one bucket reducing while
  autograd computes the next one's gradients (into its buffer, or as tensors of their own that zero2 reduces as
  they are);
- zero3 holds its part of every unit's weights, gradients and optimizer state (:mod:`paratrain.sharded.units`'s
  default policy). Its peak is in backward, which is followed unit by unit (the root first, then the units in
  the reverse of their order in the model): at each unit, its parts of the gradients of the units already
  reduced (``zero_grad`` dropped them all before), the root's whole weights, the unit's and the next one's
  (prefetched), the unit's whole gradient, and the :data:`MAX_REDUCING` units' before it less their parts (their
  reduce in flight); on NCCL also the unit's flat copy of its gradient (on gloo zero3 all-reduces autograd's own
  in place). "in flight" is that peak less the whole of its gradient parts. Against the live peak
  ``benchmarks/bench_zero_memory.py`` measures on gloo (the worst rank), within -6% .. +7% (benchmarks/README.md).

Activations are measured: the bytes a forward at each per-device batch saves for backward, parameters aside.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, assign_buckets
from paratrain.errors import ConfigError
from paratrain.sharded.flat_unit import unit_layout
from paratrain.sharded.fully_sharded import MAX_REDUCING
from paratrain.sharded.partition import shard_bucket
from paratrain.sharded.units import plan_units

__all__ = [
    "MEMORY_STRATEGIES",
    "MemoryRow",
    "Zero3Unit",
    "activation_bytes",
    "check_bytes",
    "measure_memory",
    "memory_rows",
    "parse_bytes",
    "render_memory",
    "smallest_fit",
    "state_slots",
    "zero3_backward_peak",
]

MEMORY_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class MemoryRow:
    """Bytes per device of one strategy at one world size (the most loaded rank)."""

    strategy: str
    world_size: int
    parameters: int
    gradients: int
    optimizer: int
    in_flight: int  # zero2: whole bucket buffers held while backward runs; zero3: its backward's peak beyond its parts
    activations: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.in_flight + self.activations


def parse_bytes(text: str) -> int:
    """``80GB`` (decimal units), ``80GiB`` (binary), or a number of bytes.

    Raises:
        ConfigError: anything else.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match[2].lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"expected a size such as 80GB, 24GiB or 512MB; found {text!r}")
    return int(float(match[1]) * _UNITS[unit])


def check_bytes(text: str | None) -> str | None:
    """A settings check: None when ``text`` is a size :func:`parse_bytes` reads."""
    if text is None:
        return None
    try:
        parse_bytes(text)
    except ConfigError:
        return "a size such as 80GB, 24GiB or 512MB"
    return None


def state_slots(optimizer: str, momentum: float) -> int:
    """Per-element state tensors of ``paratrain train``'s optimizers: sgd 1 with momentum (else 0), adamw 2."""
    if optimizer == "adamw":
        return 2
    return 1 if momentum else 0


def memory_rows(
    model: nn.Module,
    optimizer: str,
    momentum: float,
    world_sizes: Iterable[int],
    activations: Callable[[int], int],
    bucket_cap_bytes: int = 25 * 2**20,
    backend: str = "gloo",
) -> list[MemoryRow]:
    """Every strategy's bytes per device at every world size; ``activations(n)`` gives the measured activations,
    ``backend`` (gloo or nccl) how zero3 reduces its gradients (:func:`zero3_backward_peak`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    buckets = assign_buckets(params, bucket_cap_bytes, FIRST_BUCKET_BYTES)
    numels = [p.numel() for p in params]
    slots = state_slots(optimizer, momentum)
    has_step = optimizer == "adamw"  # torch's Adam family keeps a float32 step count per parameter it updates
    rows = []
    for n in world_sizes:
        act = activations(n)
        for strategy in MEMORY_STRATEGIES:
            if strategy == "zero3":
                rows.append(_zero3_row(model, n, slots, has_step, act, backend))
                continue
            parameters = gradients = state = in_flight = 0
            for bucket in buckets:
                size = _itemsize(bucket.dtype)
                if strategy == "ddp":
                    parameters += bucket.numel * size
                    gradients += bucket.numel * size
                    state += slots * bucket.numel * size + 4 * has_step * len(bucket.indices)
                    continue
                shards = shard_bucket(bucket, numels, n)
                parameters += shards.padded * size
                gradients += (bucket.numel if strategy == "zero1" else shards.part) * size
                state += slots * shards.real(0) * size + 4 * has_step * len(shards.pieces[0])
            if strategy == "zero2":
                largest = sorted(
                    (shard_bucket(b, numels, n).padded * _itemsize(b.dtype) for b in buckets), reverse=True
                )
                in_flight = sum(largest[:2])
            rows.append(MemoryRow(strategy, n, parameters + frozen, gradients, state, in_flight, act))
    return rows


@dataclass(frozen=True)
class Zero3Unit:
    """One zero3 unit's bytes at a world size: whole (gathered, or its whole gradient) and this rank's part."""

    whole: int
    part: int
    trains: bool = True  # it has gradients
    root: bool = False


def zero3_backward_peak(units: Sequence[Zero3Unit], backend: str) -> int:
    """The most bytes beyond the weights' and optimizer state's parts that zero3 holds while backward runs
    (module docstring): units in the model's order (the root anywhere; its backward comes first)."""
    root = next((u for u in units if u.root), None)
    order = ([root] if root else []) + [u for u in reversed(units) if not u.root]
    copies = 1 if backend == "gloo" else 2  # autograd's gradient, and elsewhere the flat buffer it is copied into
    peak = done = 0
    for j, unit in enumerate(order):
        weights = (root.whole if root else 0) + (unit.whole if unit is not root else 0)
        weights += order[j + 1].whole if j + 1 < len(order) else 0  # prefetched
        beside = [u for u in order[max(0, j - MAX_REDUCING) : j] if u.trains]  # their reduce in flight
        grads = (copies * unit.whole if unit.trains else 0) + sum(u.whole - u.part for u in beside)
        peak = max(peak, done + weights + grads)
        done += unit.part if unit.trains else 0
    return peak


def _zero3_row(model: nn.Module, n: int, slots: int, has_step: bool, activations: int, backend: str) -> MemoryRow:
    """zero3's bytes on rank 0 at world size ``n``, from the units its default policy makes."""
    parameters = gradients = state = 0
    units = []
    for k, unit in enumerate(plan_units(model)):
        layout = unit_layout(k, [p.numel() for p in unit.params], unit.params[0].dtype, torch.device("cpu"), n)
        size = _itemsize(unit.params[0].dtype)
        trains = [i for i, p in enumerate(unit.params) if p.requires_grad]
        parameters += layout.part * size
        mine = [piece for piece in layout.pieces[0] if piece.param in trains]
        state += slots * sum(piece.length for piece in mine) * size + 4 * has_step * len(mine)
        if trains:
            gradients += layout.part * size
        units.append(Zero3Unit(layout.padded * size, layout.part * size, bool(trains), unit.name == ""))
    in_flight = zero3_backward_peak(units, backend) - gradients
    return MemoryRow("zero3", n, parameters, gradients, state, in_flight, activations)


def smallest_fit(rows: Sequence[MemoryRow], device_bytes: int) -> dict[str, int | None]:
    """The fewest devices each strategy fits on (None: not within the world sizes given)."""
    found: dict[str, int | None] = {}
    for strategy in MEMORY_STRATEGIES:
        fits = [r.world_size for r in rows if r.strategy == strategy and r.total <= device_bytes]
        found[strategy] = min(fits) if fits else None
    return found


def activation_bytes(model: nn.Module, sample: torch.Tensor, batch: int) -> int:
    """Bytes a forward at ``batch`` samples (``sample`` repeated) saves for backward, parameters excluded."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    inputs = sample.expand(batch, *sample.shape[1:]).contiguous()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs)
    return sum(seen.values())


def render_memory(rows: Sequence[MemoryRow], device_bytes: int | None) -> list[str]:
    """The memory table, and with ``device_bytes`` the fewest devices each strategy fits on."""
    from paratrain.tools.report import format_table  # the report module builds on the others; only rendering needs it

    sizes = sorted({r.world_size for r in rows})
    by = {(r.strategy, r.world_size): r for r in rows}
    headers = [
        "world size",
        "activations",
        *(f"{s} states" for s in MEMORY_STRATEGIES),
        *(f"{s} total" for s in MEMORY_STRATEGIES),
    ]
    table = []
    for n in sizes:
        first = by["ddp", n]
        states = [_size(by[s, n].model_states) for s in MEMORY_STRATEGIES]
        totals = [
            _size(by[s, n].total) + (" *" if device_bytes and by[s, n].total > device_bytes else "")
            for s in MEMORY_STRATEGIES
        ]
        table.append([str(n), _size(first.activations), *states, *totals])
    lines = [
        "memory per device (the most loaded rank): model states counted as each strategy allocates them; "
        "activations measured from a forward at the per-device batch; total adds zero2's buckets and zero3's whole "
        "units in flight",
        format_table(headers, table),
    ]
    if device_bytes:
        fit = smallest_fit(rows, device_bytes)
        said = ", ".join(f"{s} {n if n is not None else f'> {max(sizes)}'}" for s, n in fit.items())
        lines.append(f"with {_size(device_bytes)} per device (* does not fit), the fewest devices that fit: {said}")
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def measure_memory(
    model: nn.Module,
    sample: torch.Tensor,
    optimizer: str,
    momentum: float,
    per_device: dict[int, int],
    backend: str = "gloo",
) -> list[MemoryRow]:
    """:func:`memory_rows` at each world size of ``per_device`` (its per-device batch), activations measured."""
    saved = {batch: activation_bytes(model, sample, batch) for batch in sorted(set(per_device.values()))}
    return memory_rows(model, optimizer, momentum, sorted(per_device), lambda n: saved[per_device[n]], backend=backend)
