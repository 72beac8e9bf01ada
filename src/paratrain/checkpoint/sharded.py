"""Checkpoints that no rank holds whole: each rank writes its own slices; any world size reads what it needs.

A sharded checkpoint is a directory named like a checkpoint file without ``.pt``::

    epoch-0001-step-000100/
        index.pt          every tensor's path in the state (and its aliases), its whole shape and dtype, and where
                          each of its slices lies (file, range, sha256); the plain values; written last, by rank
                          0, through save_checkpoint (atomic, with its own digest)
        shard-00000.pt    the slices rank 0 wrote, one flat tensor each; shard-00001.pt rank 1's, ...

The layout is that of the state a single process would save (``{"model": model.state_dict(), "optimizer":
optimizer.state_dict(), ...}``, tensors whole and named as torch names them): a slice is a range of a tensor's
flattened elements, so nothing in it depends on the world size, the strategy or the buckets that wrote it. A
value is marked for this layout by what holds it: :class:`LocalSlices` (this rank's ranges of a tensor),
:class:`Owned` (a value only this rank has) and :class:`Alias` (another key of the same dict: a tied weight,
stored once); everything else is rank 0's. Reading gives :class:`StoredTensor` leaves that read a range (only the
slices that overlap it, memory-mapped, each checked against its digest) or the whole tensor, one object under a
tensor's key and every alias of it; :func:`materialize` turns a state into plain tensors (a tied weight's keys
then hold one tensor, as in a state dict torch saves).

Writing goes to a hidden ``.NAME.partial`` directory, renamed into place once the index is written, so a crash
mid-save leaves the previous checkpoint as it was, and a directory that is there is complete::

    save_sharded(state, directory, "epoch-0001-step-000100", rank=r, world_size=n, barrier=par.barrier)
    stored = open_sharded(directory / "epoch-0001-step-000100")
    stored["optimizer"]["state"][3]["exp_avg"].read(1000, 500)
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.file import _first_line, _os_error_in, load_checkpoint, save_checkpoint, state_digest
from paratrain.checkpoint.location import INDEX, is_sharded_checkpoint, publish
from paratrain.errors import CheckpointError, ConfigError
from paratrain.files import atomic_writer, fsync_directory

__all__ = [
    "INDEX",
    "Alias",
    "LocalSlices",
    "Owned",
    "StoredTensor",
    "has_shards",
    "is_sharded_checkpoint",
    "materialize",
    "open_sharded",
    "read_plain",
    "save_sharded",
    "verify_sharded",
]

LAYOUT = "paratrain-sharded"
# 2: a tensor may have aliases (tied weights); a checkpoint without any is written as 1, which older readers read
LAYOUT_VERSION = 2
_SLOT = "<paratrain: a tensor stored in slices>"  # where a sliced tensor sits in the index's plain state

Path_ = tuple[Any, ...]  # a value's place in the state: the keys from the top


@dataclass
class LocalSlices:
    """This rank's ranges of a tensor that no rank holds whole: ``(first element, 1-d values)`` of the flattened
    tensor of ``shape``. Every rank lists its own; together they cover every element once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    slices: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class Owned:
    """A value that only this rank holds (say, an optimizer's step count of a parameter whose start it owns)."""

    value: Any


@dataclass
class Alias:
    """The tensor of another key of the same dict, whose value is :class:`LocalSlices`: a weight shared by two
    modules (``{"embed.weight": LocalSlices(...), "head.weight": Alias("embed.weight")}``), stored once; reading
    gives both keys the same tensor."""

    key: Any


def has_shards(state: Any) -> bool:
    """Whether ``state`` holds :class:`LocalSlices`, :class:`Owned` or :class:`Alias` values (it then needs
    :func:`save_sharded`)."""
    if isinstance(state, (LocalSlices, Owned, Alias)):
        return True
    if isinstance(state, Mapping):
        return any(has_shards(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_shards(v) for v in state)
    return False


@dataclass
class _Parts:
    """What :func:`_split` takes out of a state: the sliced tensors, the owned values, the aliases, by path."""

    sliced: list[tuple[Path_, LocalSlices]] = field(default_factory=list)
    owned: list[tuple[Path_, Any]] = field(default_factory=list)
    aliases: list[tuple[Path_, Path_]] = field(default_factory=list)  # (the alias, the tensor it names)


def _split(state: Any, path: Path_, parts: _Parts) -> Any:
    """``state`` without its sharded values (collected with their paths); sliced tensors leave a slot behind."""
    if isinstance(state, Mapping):
        plain: dict[Any, Any] = OrderedDict() if isinstance(state, OrderedDict) else {}
        for key, value in state.items():
            if isinstance(value, LocalSlices):
                parts.sliced.append(((*path, key), value))
                plain[key] = _SLOT
            elif isinstance(value, Owned):
                parts.owned.append(((*path, key), value.value))
            elif isinstance(value, Alias):
                if not isinstance(state.get(value.key), LocalSlices):
                    raise ConfigError(
                        f"{_name((*path, key))} is an alias of {value.key!r}, which is no sliced tensor of the same "
                        f"dict: an Alias names a key whose value is LocalSlices"
                    )
                parts.aliases.append(((*path, key), (*path, value.key)))
                plain[key] = _SLOT
            else:
                plain[key] = _split(value, (*path, key), parts)
        return plain
    if isinstance(state, (list, tuple)):
        if any(isinstance(v, (LocalSlices, Owned, Alias)) for v in state):
            raise ConfigError(f"sharded values must sit in dicts, not directly in a list; found one at {path}")
        return type(state)(_split(v, (*path, i), parts) for i, v in enumerate(state))
    return state


def _shard_file(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


def save_sharded(
    state: Mapping[str, Any],
    directory: str | Path,
    name: str,
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    agree: Callable[[str | None], dict[int, str]] | None = None,
) -> Path:
    """Write ``state`` as the sharded checkpoint ``directory/name``; every rank calls it; returns the directory.

    Each rank writes its own slices and owned values; rank 0 writes the plain values and the index, then
    renames the checkpoint into place (replacing one of the same name). ``barrier`` waits for every rank.
    ``agree``, where the ranks share a store, replaces the barrier at each of the save's three meeting points
    (the directory made, the slices written, the checkpoint published): every rank calls it with what went wrong
    on it (None: nothing) and gets every rank's failure by rank, so a rank that failed is named to the others at
    once and every rank raises the same error, instead of the others waiting for it in a barrier until the
    timeout (:meth:`paratrain.comm.meeting.Meeting.exchange`). Without it a rank that fails raises alone.

    Raises:
        CheckpointError: a file could not be written (the previous checkpoint of that name stays, nothing is
            published), or the ranks' slices do not cover their tensors exactly once.
    """
    directory = Path(directory)
    final, partial = directory / name, directory / f".{name}.partial"

    def meet(failure: str | None, cause: BaseException | None = None) -> None:
        """Every rank's next meeting point: raise, on every rank, if any rank failed (``cause``: this one's error)."""
        if agree is None:
            if failure is not None:
                raise CheckpointError(_failed(final, {rank: failure})) from cause
            barrier()
            return
        failed = agree(failure)
        if failed:
            if rank == 0:  # every rank is past its writes: nothing is left half-written under any name
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(_failed(final, failed)) from cause

    failure: str | None = None
    cause: BaseException | None = None
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
            partial.mkdir(parents=True)
        except OSError as exc:
            failure, cause = f"rank 0 could not make {partial}: {_reason(exc)}", exc
    meet(failure, cause)
    parts = _Parts()
    plain = _split(state, (), parts)
    data: dict[int, torch.Tensor] = {}
    records = []
    for path, value in parts.sliced:
        for start, values in value.slices:
            flat = values.detach().reshape(-1).to("cpu", copy=True)  # a copy: saving a view writes its storage
            key = len(data)
            data[key] = flat
            digest = state_digest({"slice": flat})
            records.append((path, tuple(value.shape), _dtype_name(value.dtype), start, flat.numel(), key, digest))
    writing = partial / _shard_file(rank)
    try:
        with atomic_writer(writing, "wb", durable=True) as stream:
            torch.save(data, stream)
        writing = partial / f"shard-{rank:05d}.meta.pt"
        with atomic_writer(writing, "wb", durable=True) as stream:
            torch.save({"records": records, "owned": parts.owned}, stream)
    except Exception as exc:  # torch's zip writer reports a failed write as a RuntimeError, the OSError inside
        if agree is None and not isinstance(_os_error_in(exc), OSError):
            raise
        failure, cause = f"rank {rank} could not write {writing}: {_reason(exc)}", exc
    meet(failure, cause)
    if rank == 0:
        try:
            index = _index(partial, plain, world_size, parts.aliases)  # every rank's aliases are rank 0's
            save_checkpoint(index, partial, INDEX)
            _publish(partial, final)
        except Exception as exc:
            if agree is None:
                raise
            failure, cause = f"rank 0 could not publish it: {_reason(exc)}", exc
    meet(failure, cause)
    return final


def _reason(exc: BaseException) -> str:
    """What the operating system said (``File too large (errno 27)``), or the exception's first sentence."""
    found = _os_error_in(exc)
    if found is not None:
        return f"{found.strerror or found} (errno {found.errno})"
    return _first_line(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {_first_line(exc)}"


def _failed(final: Path, failed: Mapping[int, str]) -> str:
    """The error every rank raises when one of them failed: the same words on each, naming every rank that did."""
    said = "; ".join(failed[r] for r in sorted(failed))
    return (
        f"checkpoint {final} was not written: {said}. Nothing was published, and the checkpoints already in "
        f"{final.parent} are intact. Check free space, file-size limits and permissions there"
    )


def _index(partial: Path, plain: Any, world_size: int, aliases: list[tuple[Path_, Path_]]) -> dict[str, Any]:
    """The index from every rank's records: each tensor's slices (checked to cover it once) and aliases, the owned
    values."""
    tensors: dict[Path_, dict[str, Any]] = {}
    for r in range(world_size):
        meta_path = partial / f"shard-{r:05d}.meta.pt"
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
        for path, shape, dtype, start, length, key, digest in meta["records"]:
            entry = tensors.setdefault(path, {"path": path, "shape": shape, "dtype": dtype, "slices": []})
            if (entry["shape"], entry["dtype"]) != (shape, dtype):
                raise CheckpointError(
                    f"ranks disagree on {_name(path)}: {entry['shape']} {entry['dtype']} and {shape} {dtype}"
                )
            entry["slices"].append((_shard_file(r), key, start, length, digest))
        for path, value in meta["owned"]:
            _insert(plain, path, value, f"rank {r}'s {_name(path)}")
        meta_path.unlink()  # what it said is in the index now, under the index's digest
    for entry in tensors.values():
        entry["slices"].sort(key=lambda s: s[2])
        _check_coverage(entry)
        _insert_slot(plain, entry["path"])
    for alias, target in aliases:
        if target not in tensors:
            raise CheckpointError(f"{_name(alias)} is an alias of {_name(target)}, of which no rank wrote a slice")
        tensors[target].setdefault("aliases", []).append(alias)
        _insert_slot(plain, alias)
    files = {f.name: f.stat().st_size for f in sorted(partial.glob("shard-*.pt"))}
    return {
        "layout": LAYOUT,
        "layout_version": LAYOUT_VERSION if aliases else 1,
        "world_size": world_size,
        "files": files,
        "tensors": list(tensors.values()),
        "state": plain,
    }


def _check_coverage(entry: dict[str, Any]) -> None:
    numel = 1
    for size in entry["shape"]:
        numel *= size
    at = 0
    for _file, _key, start, length, _digest in entry["slices"]:
        if start != at:
            what = "overlap" if start < at else f"leave elements {at}..{start - 1} out"
            raise CheckpointError(f"the ranks' slices of {_name(entry['path'])} {what}: nothing was published")
        at += length
    if at != numel:
        raise CheckpointError(
            f"the ranks' slices of {_name(entry['path'])} cover {at} of its {numel} elements: nothing was published"
        )


def _insert(tree: Any, path: Path_, value: Any, what: str) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    if path[-1] in node and node[path[-1]] != _SLOT:
        raise CheckpointError(f"{what} is also in another rank's state: two ranks claim it")
    node[path[-1]] = value


def _insert_slot(tree: Any, path: Path_) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node.setdefault(path[-1], _SLOT)


def _publish(partial: Path, final: Path) -> None:
    """Rename the finished checkpoint into place (over what stood at ``final``, a file or a directory), durably."""
    fsync_directory(partial)
    publish(partial, final)


# -- reading -----------------------------------------------------------------------------------------------------


class _Reader:
    """The shard files of one checkpoint, opened memory-mapped when first needed; each slice checked once."""

    def __init__(self, directory: Path, sizes: Mapping[str, int]) -> None:
        self.directory = directory
        self.sizes = dict(sizes)
        self._files: dict[str, dict[int, torch.Tensor]] = {}
        self.verified: set[tuple[str, int]] = set()  # (file, key): the slices read so far

    def check_size(self, file: str) -> None:
        """Raise CheckpointError when ``file`` is missing or not the size the index says (a stat, nothing read)."""
        path = self.directory / file
        size = path.stat().st_size if path.is_file() else None
        if size != self.sizes.get(file):
            found = "missing" if size is None else f"{size} bytes"
            raise CheckpointError(
                f"checkpoint {self.directory}: {file} is {found}, the index says {self.sizes.get(file)} bytes "
                f"(cut short, removed or replaced): resume from an earlier checkpoint"
            )

    def slice(self, file: str, key: int, digest: str) -> torch.Tensor:
        if file not in self._files:
            self.check_size(file)
            path = self.directory / file
            try:
                self._files[file] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:
                raise CheckpointError(f"checkpoint {self.directory}: cannot read {file}: {exc}") from exc
        values = self._files[file][key]
        if (file, key) not in self.verified:
            if state_digest({"slice": values}) != digest:
                raise CheckpointError(
                    f"checkpoint {self.directory} is damaged: a slice in {file} does not match its digest (bytes "
                    f"changed on disk or in a copy); resume from an earlier checkpoint"
                )
            self.verified.add((file, key))
        return values


class StoredTensor:
    """A tensor of a sharded checkpoint, read on demand: a range of its flattened elements, or all of it."""

    def __init__(self, reader: _Reader, entry: Mapping[str, Any]) -> None:
        self._reader = reader
        self.path: Path_ = tuple(entry["path"])
        self.shape = tuple(entry["shape"])
        self.dtype: torch.dtype = getattr(torch, entry["dtype"])
        self._slices = list(entry["slices"])

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def read(self, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened tensor (1-d, on the CPU), from the slices with them."""
        if start < 0 or length < 0 or start + length > self.numel:
            raise CheckpointError(f"{_name(self.path)} has {self.numel} elements; asked for {start}..{start + length}")
        out = torch.empty(length, dtype=self.dtype)
        for file, key, first, count, digest in self._slices:
            lo, hi = max(start, first), min(start + length, first + count)
            if lo < hi:
                values = self._reader.slice(file, key, digest)
                out[lo - start : hi - start] = values[lo - first : hi - first]
        return out

    def full(self) -> torch.Tensor:
        return self.read(0, self.numel).view(self.shape)

    def __repr__(self) -> str:
        return f"StoredTensor({_name(self.path)}, shape={self.shape}, dtype={self.dtype})"


def open_sharded(path: str | Path) -> dict[str, Any]:
    """The state of the sharded checkpoint at ``path``, its sliced tensors as :class:`StoredTensor` (nothing read yet).

    Raises:
        CheckpointError: no index, an index that is damaged or of a newer layout, a shard file missing or not
            the size the index says (the slices' digests are checked as they are read).
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is not a sharded checkpoint: it has no {INDEX}")
    index = load_checkpoint(path / INDEX)  # checks the index's own digest
    if index.get("layout") != LAYOUT or not isinstance(index.get("layout_version"), int):
        raise CheckpointError(f"{path / INDEX} is not the index of a paratrain sharded checkpoint")
    if index["layout_version"] > LAYOUT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer paratrain (sharded layout {index['layout_version']}; this one reads up to "
            f"{LAYOUT_VERSION}): upgrade paratrain to resume from it"
        )
    reader = _Reader(path, index["files"])
    for file in index["files"]:  # a file removed or cut short is refused at once, before any process trains
        reader.check_size(file)
    state: dict[str, Any] = index["state"]
    for entry in index["tensors"]:
        stored = StoredTensor(reader, entry)
        for where in (entry["path"], *entry.get("aliases", ())):
            _place(state, tuple(where), stored)  # an alias: the same object, so the same tensor once read
    return state


def _place(tree: Any, path: Path_, value: StoredTensor) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def materialize(state: Any) -> Any:
    """``state`` with every :class:`StoredTensor` read whole (a plain state, as a single process saves it); one
    read under all its keys (a tied weight's)."""
    return _materialize(state, {})


def _materialize(state: Any, read: dict[int, torch.Tensor]) -> Any:
    if isinstance(state, StoredTensor):
        if id(state) not in read:
            read[id(state)] = state.full()
        return read[id(state)]
    if isinstance(state, Mapping):
        out: dict[Any, Any] = OrderedDict() if isinstance(state, OrderedDict) else {}
        for key, value in state.items():
            out[key] = _materialize(value, read)
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(_materialize(v, read) for v in state)
    return state


def read_plain(path: str | Path) -> dict[str, Any]:
    """A checkpoint's state without reading any slice: a file whole, a sharded checkpoint's index (lazy tensors)."""
    return open_sharded(path) if is_sharded_checkpoint(path) else load_checkpoint(path)


def verify_sharded(path: str | Path) -> dict[str, Any]:
    """Read every slice of the checkpoint (checking each digest); the whole state, as :func:`materialize` gives it."""
    return materialize(open_sharded(path))  # type: ignore[no-any-return]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _name(path: Path_) -> str:
    return "/".join(str(key) for key in path)
