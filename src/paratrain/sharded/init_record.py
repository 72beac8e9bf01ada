"""A model's construction on the meta device, recorded and replayed later one tensor at a time.

    with record_init() as record:                         # the meta device, and every call on its tensors logged
        model = GPT(config)                               # nanoGPT: modules, then apply(_init_weights), then c_proj
    record.replay(device, finalize)                       # the same calls on real tensors, the same random draws

A plain build draws its weights as its constructor runs: each module's ``reset_parameters()``, then whatever the
script does after (nanoGPT's ``self.apply(self._init_weights)`` and its scaled ``c_proj`` weights), each draw
from the generator in turn. On the meta device those calls do nothing. The record keeps every top-level torch
call that touches a meta tensor (``torch.empty``, ``nn.init.normal_``, ``weight[padding_idx].fill_(0)``,
``torch.ones`` for a LayerNorm without ``reset_parameters``) and the generator's state when building began;
:meth:`InitRecord.replay` sets that state, runs the calls in order on real tensors and restores the caller's state.

A tensor lives in replay only while its value can still be read: a storage is allocated at the call that first
writes it and released after its last use, or before a call that overwrites it whole (``normal_``, ``uniform_``,
``zero_``, an ``nn.init`` function), so that the weights a constructor draws and ``apply(init)`` then replaces
cost one tensor at a time, never the whole model. When a storage's last use is done its final value is handed to
``finalize`` (zero3 keeps this rank's part of each parameter in its unit's shard).

Hugging Face's models skip their ``_init_weights`` (``post_init``) when built on the meta device; while recording
they are told they are not, so their initialisation is recorded as well (:func:`_transformers_init_runs`).

At the end of the ``with`` block the record is replayed once on the CPU and the values dropped, so the generator
is left where a plain build would leave it: the script's next draws (data, dropout) are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from paratrain.errors import ConfigError

__all__ = ["InitRecord", "find_record", "record_init", "storage_key"]

# calls that write every element of their first tensor without reading it: what was there before is dead
_OVERWRITES: set[Any] = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.zero_,
    torch.Tensor.fill_,
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.copy_,
    nn.init.normal_,
    nn.init.uniform_,
    nn.init.constant_,
    nn.init.ones_,
    nn.init.zeros_,
    nn.init.eye_,
    nn.init.dirac_,
    nn.init.xavier_uniform_,
    nn.init.xavier_normal_,
    nn.init.kaiming_uniform_,
    nn.init.kaiming_normal_,
    nn.init.trunc_normal_,
    nn.init.orthogonal_,
    nn.init.sparse_,
}

# torch.nn.init's functions among them, by name: a library may put a stand-in of its own under one of these names
# while its init runs (Hugging Face's guard_torch_init_functions), and torch then dispatches the stand-in
_INIT_OVERWRITES = {f.__name__ for f in _OVERWRITES if getattr(f, "__module__", None) == nn.init.__name__}

_RECORDS: weakref.WeakSet[InitRecord] = weakref.WeakSet()


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (tensors that share one share the key, Parameters with their data)."""
    return int(t.untyped_storage()._cdata)


def _meta_tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor) and x.is_meta]


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A meta tensor in a recorded call: a window onto a storage."""

    storage: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass
class _Storage:
    numel: int
    dtype: torch.dtype
    uses: list[int] = dataclasses.field(default_factory=list)  # the calls that touch it, in order
    overwritten: set[int] = dataclasses.field(default_factory=set)  # the calls that write it whole unread


@dataclasses.dataclass
class _Call:
    func: Any
    args: Any  # the call's (args, kwargs) with each meta tensor replaced by a _Ref
    outputs: list[_Ref]


# in-place by name but metadata only: they change no element
_METADATA = {"requires_grad_", "retain_grad", "share_memory_", "register_hook", "resize_as_"}


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The meta tensors a call writes: an in-place call's first tensor (``normal_``, ``nn.init.*_``,
    ``__setitem__``) and what ``out=`` names."""
    name = getattr(func, "__name__", "")
    written = _meta_tensors(kwargs.get("out"))
    if name == "__setitem__" or (name.endswith("_") and not name.startswith("__") and name not in _METADATA):
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if isinstance(target, torch.Tensor) and target.is_meta:
            written.insert(0, target)
    return written


def _overwrites(func: Any) -> bool:
    """``func`` writes every element of its first tensor unread: one of :data:`_OVERWRITES`, or what stands in
    for one of torch.nn.init's under its name at this moment."""
    if func in _OVERWRITES:
        return True
    name = getattr(func, "__name__", "")
    return name in _INIT_OVERWRITES and getattr(nn.init, name, None) is func


def _name(call: _Call) -> str:
    return repr(getattr(call.func, "__name__", str(call.func)))


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(storage_key(t), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def _whole(ref: _Ref, storage: _Storage) -> bool:
    """``ref`` covers its storage exactly, element by element (a contiguous view of all of it)."""
    numel, expected = 1, 1
    contiguous = True
    for size, stride in reversed(list(zip(ref.shape, ref.stride, strict=True))):
        contiguous = contiguous and (size == 1 or stride == expected)
        expected *= size
        numel *= size
    return ref.offset == 0 and numel == storage.numel and contiguous


class _Recorder(TorchFunctionMode):
    """Logs each top-level torch call that touches a meta tensor (calls made inside it are its own business)."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record
        self.depth = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.depth += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= 1
        if self.depth == 0:
            self.record._log(func, args, kwargs, out)
        return out


class InitRecord:
    """The calls that built a model on the meta device (module docstring), and the generator's state before."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.storages: dict[int, _Storage] = {}
        self._keep: list[torch.Tensor] = []  # the meta tensors seen: their storages (and keys) stay unique
        self.peak_bytes = 0  # the most bytes the last replay held at once (its live storages)
        self.cpu_state = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_state = torch.cuda.get_rng_state() if cuda else None
        _RECORDS.add(self)

    def _log(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Keep a call that makes a storage or writes one (what replay must do); views, aliases and metadata
        (``weight.data``, ``w[0]``, ``size()``, ``requires_grad_()``) are left out: replay reaches every tensor
        through its storage, and a call that only looks would keep every storage alive to its end."""
        inputs, outputs = _meta_tensors((args, kwargs)), _meta_tensors(out)
        if not inputs and not outputs:
            return
        given = {storage_key(t) for t in inputs}
        written = _written(func, args, kwargs)
        created = [t for t in outputs if storage_key(t) not in given and storage_key(t) not in self.storages]
        if not written and not created:
            return
        at = len(self.calls)
        for t in (*inputs, *outputs):
            key = storage_key(t)
            if key not in self.storages:
                self.storages[key] = _Storage(t.untyped_storage().nbytes() // t.element_size(), t.dtype)
                self._keep.append(t)
            storage = self.storages[key]
            if not storage.uses or storage.uses[-1] != at:
                storage.uses.append(at)
        if _overwrites(func) and written:
            target = written[0]
            ref = _ref(target)
            storage = self.storages[ref.storage]
            read_too = any(storage_key(t) == ref.storage for t in inputs if t is not target)
            if _whole(ref, storage) and not read_too:
                storage.overwritten.add(at)
        refs = tree_map(lambda x: _ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, (args, kwargs))
        self.calls.append(_Call(func, refs, [_ref(t) for t in outputs]))

    def covers(self, tensors: list[torch.Tensor]) -> bool:
        """Every one of ``tensors`` (a model's meta parameters and buffers) was made while this was recording."""
        return bool(tensors) and all(storage_key(t) in self.storages for t in tensors)

    def replay(self, device: torch.device, finalize: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Run the recorded calls on ``device`` from the generator state building began with (the caller's state
        is restored after); ``finalize(key, flat)`` receives each storage's final value (a 1-D tensor of its
        elements, valid during the call) after its last use."""
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if device.type == "cuda" else None
        torch.set_rng_state(self.cpu_state)
        if device.type == "cuda" and self.cuda_state is not None:
            torch.cuda.set_rng_state(self.cuda_state)
        try:
            self._run(device, finalize)
        finally:
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda)

    def advance(self) -> None:
        """Run the recorded calls on the CPU and drop the values: the generator moves on as a plain build's did."""
        self._run(torch.device("cpu"), None)

    def _run(self, device: torch.device, finalize: Callable[[int, torch.Tensor], None] | None) -> None:
        self.peak_bytes = 0
        live: dict[int, torch.Tensor] = {}  # a storage -> its elements, flat, while its value can be read

        at = 0

        def real(ref: _Ref) -> torch.Tensor:
            flat = live.get(ref.storage)
            if flat is None:
                storage = self.storages[ref.storage]
                if at not in storage.overwritten:  # not made by any call before, nor overwritten whole by this one
                    raise ConfigError(
                        f"the model's construction read a meta tensor it did not make ({_name(self.calls[at])} "
                        f"took one made before the block began): build all of the model inside init_module()"
                    )
                flat = live[ref.storage] = torch.empty(storage.numel, dtype=storage.dtype, device=device)
            return flat.as_strided(ref.shape, ref.stride, ref.offset)

        def substitute(x: Any) -> Any:
            if isinstance(x, _Ref):
                return real(x)
            if isinstance(x, torch.device) and x.type == "meta":
                return device
            if isinstance(x, str) and x == "meta":
                return str(device)
            return x

        with torch.no_grad(), torch.device(device):
            for at, call in enumerate(self.calls):
                given = self._touched(at)
                made = [ref for ref in call.outputs if ref.storage not in live and ref.storage not in given]
                args, kwargs = tree_map(substitute, call.args, is_leaf=lambda x: isinstance(x, _Ref))
                out = call.func(*args, **kwargs)
                results = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
                for ref in made:
                    found = next((t for t in results if tuple(t.shape) == ref.shape), None)
                    if found is None or found.untyped_storage().nbytes() < self._bytes(ref.storage):
                        raise ConfigError(
                            f"cannot replay {_name(call)} of the model's construction "
                            f"on {device}: its result is not the tensor it made on the meta device; build the model "
                            f"on a real device"
                        )
                    storage = self.storages[ref.storage]
                    live[ref.storage] = found.as_strided((storage.numel,), (1,), found.storage_offset() - ref.offset)
                held = sum(flat.numel() * flat.element_size() for flat in live.values())
                self.peak_bytes = max(self.peak_bytes, held)
                self._release(at, live, finalize)

    def _bytes(self, key: int) -> int:
        storage = self.storages[key]
        return storage.numel * torch.empty((), dtype=storage.dtype).element_size()

    def _release(
        self, at: int, live: dict[int, torch.Tensor], finalize: Callable[[int, torch.Tensor], None] | None
    ) -> None:
        """After call ``at``: hand over each storage it touched for the last time; drop those overwritten next."""
        for key in {ref.storage for ref in self.calls[at].outputs} | self._touched(at):
            storage = self.storages[key]
            position = storage.uses.index(at)
            if position + 1 == len(storage.uses):
                flat = live.pop(key, None)
                if flat is not None and finalize is not None:
                    finalize(key, flat)
            elif storage.uses[position + 1] in storage.overwritten:
                live.pop(key, None)

    def _touched(self, at: int) -> set[int]:
        refs = [x for x in tree_flatten(self.calls[at].args, is_leaf=lambda x: isinstance(x, _Ref))[0]]
        return {x.storage for x in refs if isinstance(x, _Ref)}


@contextlib.contextmanager
def record_init() -> Iterator[InitRecord]:
    """Build on the meta device and record it (module docstring); the generator ends where a plain build's does."""
    record = InitRecord()
    with torch.device("meta"), _Recorder(record), _transformers_init_runs():
        yield record
    record.advance()


# Hugging Face's probe of the device context, in transformers.modeling_utils
_HF_PROBE = "get_torch_context_manager_or_global_device"


@contextlib.contextmanager
def _transformers_init_runs() -> Iterator[None]:
    """Hugging Face's models run their ``_init_weights`` (``post_init``) inside the block, as a plain build does.

    HACK: transformers 5's ``PreTrainedModel.init_weights`` skips its initialisation when its probe finds a meta
    device context, so a model built here would keep its constructors' draws only (other weights than a plain
    build's, silently). While the block runs the probe answers what it answers in a plain build on the CPU (no
    context: None), and the initialisation runs on the meta tensors and is recorded (transformers 4.57 runs it
    without asking). The probe is also how ``from_pretrained`` refuses a meta device context: inside the block it
    loads the weights onto the CPU, and ``prepare`` takes that model as built. tests/test_init_record.py checks that
    this still applies to the installed transformers (it fails, not skips, when the probe is renamed).
    """
    if "transformers" not in sys.modules:  # a model of transformers' is built after its import
        yield
        return
    module = importlib.import_module("transformers.modeling_utils")
    probe = getattr(module, _HF_PROBE, None)
    if probe is None:
        yield
        return
    setattr(module, _HF_PROBE, lambda: None)
    try:
        yield
    finally:
        setattr(module, _HF_PROBE, probe)


def find_record(tensors: list[torch.Tensor]) -> InitRecord | None:
    """The record that made all of ``tensors`` (a model's meta parameters and buffers), if one did."""
    return next((r for r in list(_RECORDS) if r.covers(tensors)), None)
