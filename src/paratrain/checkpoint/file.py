"""Checkpoints that survive crashes: atomic save, validated load.

A checkpoint is a plain dict written with ``torch.save`` and read back with ``torch.load(weights_only=True)``,
so it holds only tensors and plain Python values (no pickled classes, nothing that runs code on load). Saving
writes a temporary file next to the target and renames it into place, so a crash mid-write never destroys the
previous checkpoint of that name. Loading says what is wrong with a bad file and what to do about it::

    check_writable("runs/mnist")                     # at start-up, not an hour into training
    path = latest_checkpoint("runs/mnist")
    if path is not None:
        saved = load_checkpoint(path)
        check_compatible(model.state_dict(), saved["model"])      # from paratrain.checkpoint.state_dicts
        model.load_state_dict(strip_module_prefix(saved["model"]))
        optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved["rng"])                  # from paratrain.checkpoint.rng
    ...
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": epoch, "step": step, "rng": rng_state()}
    save_checkpoint(state, "runs/mnist", checkpoint_name(epoch, step))
    prune_checkpoints("runs/mnist", keep=3)
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.location import is_sharded_checkpoint, publish
from paratrain.checkpoint.mapped import load_mapped
from paratrain.checkpoint.state_dicts import describe_keys
from paratrain.errors import CheckpointError, ConfigError
from paratrain.files import atomic_writer
from paratrain.tree import map_tensors

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "check_writable",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "save_checkpoint",
]

FORMAT = "paratrain-checkpoint"
FORMAT_VERSION = 2  # 2: a digest of the state is written with it and checked on load

_MARKER_KEYS = ("format", "format_version", "digest")
# a file, or a sharded checkpoint's directory of the same name (an earlier paratrain's: without .pt)
_NAME_PATTERN = re.compile(r"epoch-(\d+)-step-(\d+)(\.pt)?")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save has written zip archives since torch 1.6

# What torch.load(weights_only=True) accepts, checked by exact type: numpy.float64 subclasses float and
# IntEnum subclasses int, yet the weights-only unpickler refuses both.
_PYTHON_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_LEAF_TYPES = (torch.Size, torch.dtype, torch.device)
_CONTAINER_TYPES = (dict, OrderedDict, list, tuple, set)


def checkpoint_name(epoch: int, step: int) -> str:
    """The file name for a checkpoint, zero-padded so that names sort like ``(epoch, step)``.

    >>> checkpoint_name(3, 120)
    'epoch-0003-step-000120.pt'
    """
    for label, value in (("epoch", epoch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"checkpoint {label} must be a non-negative int, found {value!r}")
    return f"epoch-{epoch:04d}-step-{step:06d}.pt"


def check_writable(directory: str | Path) -> Path:
    """Create ``directory`` if needed and prove that files can be created and deleted in it.

    Call it at start-up so that a run fails in the first second rather than at its first save.

    Raises:
        CheckpointError: naming the directory and the operating system's reason.
    """
    directory = Path(directory)
    probe = directory / f".paratrain-write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"cannot write checkpoints to {directory}: it is a file, expected a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as err:
        raise CheckpointError(
            f"cannot write checkpoints to {directory}: {_describe_os_error(err)}. "
            "Choose a directory you can write to, or fix its permissions, before training."
        ) from err
    return directory


def save_checkpoint(state: Mapping[str, Any], directory: str | Path, name: str) -> Path:
    """Write ``state`` to ``directory/name`` atomically and durably; returns the final path.

    The state goes to a temporary file in the same directory (a rename is atomic only within one file system),
    which is flushed and fsynced, renamed over ``name``, and then the directory is fsynced so the rename itself
    survives a power cut. Until the rename, an existing file called ``name`` is untouched; on an exception
    the temporary file is removed. ``{"format": FORMAT, "format_version": FORMAT_VERSION}`` is added to the
    dict that is written, and :func:`load_checkpoint` checks and removes it again.

    A sharded checkpoint at ``directory/name`` is replaced by the file (:func:`paratrain.checkpoint.location.publish`).

    Raises:
        ConfigError: ``name`` is not a plain file name, or ``state`` is not a mapping, uses a reserved key, or
            holds a value that ``torch.load(weights_only=True)`` would refuse (checked before anything is written).
        CheckpointError: the file could not be written; the previous file with that name is intact.
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"a checkpoint state must be a dict, found {type(state).__name__}")
    if name in ("", ".", "..") or Path(name).name != name:
        raise ConfigError(
            f"checkpoint name must be a plain file name such as {checkpoint_name(1, 100)!r}, found {name!r}"
        )
    reserved = [key for key in _MARKER_KEYS if key in state]
    if reserved:
        raise ConfigError(
            f"checkpoint state uses the reserved key(s) {reserved}; save_checkpoint adds them, rename yours"
        )
    # Checked up front: torch.save happily pickles a numpy array, and the run would only learn at resume time,
    # possibly hours later, that weights_only loading refuses it.
    _check_loadable(state, "state")

    directory = Path(directory)
    final = directory / name
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "digest": state_digest(state), **state}
    # over a sharded checkpoint of the same path: written beside it, then published in its place (location.py)
    over_directory = is_sharded_checkpoint(final)
    written = directory / f".{name}.file" if over_directory else final
    try:
        with atomic_writer(written, "wb", durable=True) as file:
            torch.save(payload, file)
        if over_directory:
            publish(written, final)
    except Exception as err:
        if over_directory:
            written.unlink(missing_ok=True)
        # torch's zip writer reports a failed write as "enforce fail at inline_container.cc", with the operating
        # system's reason (disk full, file too large) only in the exception it replaced
        reason = _os_error_in(err)
        why = (
            f"{reason.strerror or reason} (errno {reason.errno})"
            if reason
            else f"{type(err).__name__}: {_first_line(err)}"
        )
        raise CheckpointError(
            f"could not write checkpoint {final}: {why}. Nothing was left half-written, and the checkpoints "
            f"already in {directory} are intact. Check free space, file-size limits and permissions there."
        ) from err
    return final


def state_digest(state: Mapping[str, Any]) -> str:
    """sha256 over everything in ``state``: keys, and each value's type, dtype, shape and bytes, in order.

    Written with a checkpoint and checked when it is loaded, so a file damaged on disk or in a copy (bytes
    flipped in a tensor, not only a cut-short file) is refused instead of trained on.
    """
    digest = hashlib.sha256()
    _digest_into(digest, state)
    return digest.hexdigest()


def _digest_into(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"D{len(value)}|".encode())
        for key, item in value.items():
            _digest_into(digest, key)
            _digest_into(digest, item)
    elif isinstance(value, (list, tuple, set)):
        items = sorted(value, key=repr) if isinstance(value, set) else value
        digest.update(f"{type(value).__name__}{len(value)}|".encode())
        for item in items:
            _digest_into(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r}|".encode())


def load_checkpoint(
    path: str | Path, *, map_location: str | torch.device = "cpu", mapped: bool = False
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, with ``torch.load(weights_only=True)``.

    ``mapped``: its tensors as read-only views of the file (:func:`paratrain.checkpoint.mapped.load_mapped`), to
    be copied from, never written into; the digest is checked by reading each of them once.

    Returns the state that was saved, without the ``format`` / ``format_version`` markers.

    Raises:
        CheckpointError: the file is missing, truncated, not a torch file, holds objects weights-only loading
            refuses, is not a paratrain checkpoint, or was written by a newer paratrain. The message names the
            file and says what to do.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {path} does not exist. "
            "Pass an existing file, or use latest_checkpoint(directory) to find the newest one."
        )
    if path.is_dir():
        if (path / "index.pt").is_file():
            raise CheckpointError(
                f"checkpoint {path} is a sharded checkpoint (a directory of slices): load it with Parallel.load, or "
                f"write it as one file with `paratrain checkpoint consolidate {path} OUT.pt`"
            )
        raise CheckpointError(
            f"checkpoint {path} is a directory, expected a file; use latest_checkpoint({str(path)!r}) to pick one"
        )
    try:
        with open(path, "rb") as file:
            head = file.read(len(_ZIP_MAGIC))
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {_describe_os_error(err)}") from err
    try:
        # read on the CPU: the digest is checked there, before anything moves to map_location
        loaded = load_mapped(path) if mapped else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(_explain_load_failure(path, head, err)) from err

    if not isinstance(loaded, dict) or "format" not in loaded:
        found = (
            f"a dict with keys {describe_keys(list(loaded))}"
            if isinstance(loaded, dict)
            else f"a {type(loaded).__name__}"
        )
        raise CheckpointError(
            f"{path} is a torch file but not a paratrain checkpoint: expected a dict with a 'format' key, found "
            f"{found}. If it is a bare state_dict, load it with torch.load(path, weights_only=True) instead."
        )
    if loaded["format"] != FORMAT:
        raise CheckpointError(
            f"{path} has format {loaded['format']!r}, expected {FORMAT!r}; it was written by another tool"
        )
    version = loaded.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path} has format_version {version!r}, expected a positive int; the file is corrupt")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer paratrain (format version {version}; this one reads up to "
            f"{FORMAT_VERSION}). Upgrade paratrain to resume from it."
        )
    written = loaded.get("digest")  # format version 1 had none: nothing to check
    state = {key: value for key, value in loaded.items() if key not in _MARKER_KEYS}
    if written is not None and written != state_digest(state):
        raise CheckpointError(_damaged(path))
    if torch.device(map_location) == torch.device("cpu"):
        return state
    moved: dict[str, Any] = map_tensors(lambda t: t.to(map_location), state)
    return moved


def _damaged(path: Path) -> str:
    good = _previous_checkpoint(path)
    fallback = (
        f"The newest checkpoint before it that verifies is {good}: resume from it with --resume {good}, or delete "
        f"{path.name} so that --resume finds it."
        if good is not None
        else "No earlier checkpoint in its directory verifies: start afresh (in another directory, or after "
        "deleting the damaged files)."
    )
    return (
        f"checkpoint {path} is damaged: its contents do not match the digest written with it (bytes changed on "
        f"disk or in a copy), so training on it would start from wrong values. {fallback}"
    )


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints in ``directory``, oldest to newest by the ``(epoch, step)`` in their names.

    Only names made by :func:`checkpoint_name` count: files, and sharded checkpoints (directories of that name,
    holding an ``index.pt``; an earlier paratrain named them without ``.pt``); temporary files and anything else are
    ignored. A directory that does not exist yet holds no checkpoints.
    """
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} is a file, expected a directory")
    found = []
    for entry in directory.iterdir():
        match = _NAME_PATTERN.fullmatch(entry.name)
        if match and ((match[3] and entry.is_file()) or is_sharded_checkpoint(entry)):
            found.append(((int(match[1]), int(match[2]), entry.name), entry))
    return [entry for _, entry in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory``, or ``None`` when there is none (a fresh run)."""
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints in ``directory``; returns the deleted paths."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(
            f"keep must be an int >= 1 (keeping none would delete the run's only resume point), found {keep!r}"
        )
    doomed = list_checkpoints(directory)[:-keep]
    for path in doomed:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)  # missing_ok: another process may have pruned it already
        except OSError as err:
            raise CheckpointError(f"could not delete old checkpoint {path}: {_describe_os_error(err)}") from err
    return doomed


def _check_loadable(value: Any, where: str) -> None:
    """Raise ConfigError naming the first value in ``value`` that weights-only loading would refuse."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PYTHON_LEAF_TYPES or kind in _TORCH_LEAF_TYPES:
        return
    if kind not in _CONTAINER_TYPES:
        raise ConfigError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which torch.load(weights_only=True) refuses, so "
            "the checkpoint could not be loaded back. Store tensors and plain values (int, float, str, bool, None, "
            "list, tuple, dict): e.g. torch.as_tensor(array) for a numpy array, obj.state_dict() for an object."
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_loadable(key, f"a key of {where}")
            _check_loadable(item, f"{where}[{key!r}]")
    else:
        for index, item in enumerate(value):
            _check_loadable(item, f"{where}[{index}]")


def _explain_load_failure(path: Path, head: bytes, err: Exception) -> str:
    """Say why ``torch.load`` failed on ``path`` and what to do, from the error and the file's first bytes."""
    detail = _first_line(err)
    message = str(err)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", message)
    if refused:
        return (
            f"checkpoint {path} holds a {refused[1]}, which weights-only loading refuses, so it was not written by "
            "paratrain's save_checkpoint. If you trust its source, torch.load(path, weights_only=False) reads it."
        )
    # Torch's zip reader reports a cut-short archive as RuntimeError or OSError depending on where it stops,
    # so the file's first bytes, not the exception type, tell a damaged checkpoint from a foreign file.
    if head in (_ZIP_MAGIC, b""):
        previous = _previous_checkpoint(path)
        fallback = f" ({previous.name})" if previous is not None else ""
        return (
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {detail}); a crash, a full disk or "
            f"an interrupted copy probably cut it short. Delete it to resume from the previous checkpoint{fallback}."
        )
    return (
        f"{path} is not a PyTorch checkpoint: it starts with {head!r}, where files written by torch.save start with "
        f"{_ZIP_MAGIC!r}. Check the path; if something else overwrote a checkpoint, delete it to resume from the "
        "previous one."
    )


def _previous_checkpoint(path: Path) -> Path | None:
    """The newest checkpoint older than ``path`` in its directory that loads and verifies, if any."""
    try:
        others = list_checkpoints(path.parent)
    except CheckpointError:
        return None
    names = [other.name for other in others]
    if path.name in names:
        others = others[: names.index(path.name)]
    for candidate in reversed(others):
        try:
            if candidate.is_dir():
                _check_sharded_files(candidate)
            else:
                load_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def _check_sharded_files(directory: Path) -> None:
    """A sharded checkpoint's index verifies and its files are the sizes it lists (the slices' digests are checked
    as they are read: :mod:`paratrain.checkpoint.sharded` builds on this module, not the other way round)."""
    index = load_checkpoint(directory / "index.pt")
    for name, size in dict(index.get("files") or {}).items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {directory}: {name} is missing or not the {size} bytes its index says")


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: itself, or one it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _describe_os_error(err: OSError) -> str:
    # strerror alone ("Permission denied"): every message already names the path
    return err.strerror or str(err)


def _first_line(err: BaseException) -> str:
    """The first sentence of an exception's message: torch's run to paragraphs, and the cause stays chained."""
    text = str(err).strip()
    line = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
    return line if len(line) <= 200 else line[:197] + "..."
