"""One path, one checkpoint: the path a user gives is the path written, whichever form the checkpoint takes.

    check_target(path)                 # before a save: the parent exists, and nothing not ours stands at path
    publish(finished, path)            # the finished file or directory replaces what stood at path, either form
    found = locate(path)               # before a load: the file or sharded directory at path (or its recovery)

A checkpoint is one file (single, dp, ddp: rank 0 writes the whole state) or a directory holding an index and one
file per rank (zero1, zero2, zero3: :mod:`paratrain.checkpoint.sharded`); both live at exactly the path given, as
DCP's ``checkpoint_id`` does, so ``os.path.exists(path)`` and a later load see the newest save in either form.

A save writes the new checkpoint beside the old one and then renames it into place. A file over a file is one
atomic rename. Where the forms differ (or both are directories) POSIX has no atomic swap, so the old checkpoint is
first renamed aside to ``.NAME.replaced`` and removed once the new one stands: a crash between the two renames
leaves the old checkpoint whole under that name, and :func:`locate` loads it from there (never a mix of the two).

Checkpoints written before this rule (a sharded checkpoint at ``path`` without ``.pt``) are still found; a path
that holds both forms (a file at ``ck.pt`` and a sharded ``ck/``) is refused on load, naming both.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from paratrain.errors import CheckpointError
from paratrain.files import fsync_directory

__all__ = ["INDEX", "Located", "check_target", "is_sharded_checkpoint", "locate", "publish", "replaced_path"]

INDEX = "index.pt"  # a sharded checkpoint's index file: what makes a directory one of ours


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


def replaced_path(path: Path) -> Path:
    """Where the previous checkpoint at ``path`` waits while a save of the other form replaces it."""
    return path.parent / f".{path.name}.replaced"


def check_target(path: str | Path) -> Path:
    """``path`` as a place a checkpoint may be written: its parent exists, and what stands there (if anything) is
    a file or one of our sharded checkpoints, never a directory of something else.

    Raises:
        CheckpointError: the parent is missing or not a directory, or ``path`` is a directory that is not a
            sharded checkpoint (nothing is written).
    """
    target = Path(path)
    parent = target.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise CheckpointError(
            f"cannot save a checkpoint at {target}: its directory {parent} {what}; create the directory first "
            f"(os.makedirs({str(parent)!r}, exist_ok=True)), or give a path in an existing one"
        )
    if target.is_dir() and not is_sharded_checkpoint(target):
        entries = sorted(p.name for p in target.iterdir())[:4]
        raise CheckpointError(
            f"cannot save a checkpoint at {target}: a directory is there that is not a paratrain checkpoint (it has "
            f"no {INDEX}; it holds {entries or 'nothing'}), and a save never replaces what it did not write; give "
            f"another path, or move that directory away"
        )
    return target


def publish(finished: Path, final: Path) -> None:
    """Make ``finished`` (a file or a directory beside ``final``, fully written and synced) the checkpoint at
    ``final``, replacing what stood there in either form (module docstring)."""
    if finished.is_file() and (final.is_file() or not final.exists()):
        os.replace(finished, final)  # atomic
        fsync_directory(final.parent)
        return
    aside = replaced_path(final)
    if final.exists():
        _remove(aside)
        os.replace(final, aside)  # the old checkpoint, whole, under a name locate() knows
    os.replace(finished, final)
    fsync_directory(final.parent)
    _remove(aside)


@dataclass(frozen=True)
class Located:
    """The checkpoint found for a path: where it is, and whether it is a sharded directory."""

    path: Path
    sharded: bool


def locate(path: str | Path) -> Located:
    """The checkpoint at ``path``: the file or sharded directory there; else the previous checkpoint a save left
    aside when it crashed while replacing it; else one written before checkpoints took the exact path (a sharded
    directory at ``path`` without ``.pt``).

    Raises:
        CheckpointError: nothing is there, ``path`` is a directory that is not a sharded checkpoint, or the path
            holds a checkpoint in both forms.
    """
    given = Path(path)
    legacy = given.with_suffix("") if given.suffix == ".pt" else None
    if given.is_file():
        if legacy is not None and is_sharded_checkpoint(legacy):
            raise CheckpointError(
                f"{given} holds two checkpoints: the file {given} and the sharded checkpoint {legacy}/ (written by an "
                f"earlier paratrain, which dropped the .pt); load one of them by its own path after moving the other "
                f"away, or delete the older"
            )
        return Located(given, sharded=False)
    if given.is_dir():
        if not is_sharded_checkpoint(given):
            raise CheckpointError(
                f"{given} is a directory but not a sharded checkpoint (no {INDEX} in it): give the path par.save wrote"
            )
        return Located(given, sharded=True)
    aside = replaced_path(given)
    if aside.exists():  # a save crashed between moving the old checkpoint aside and renaming the new one in
        return Located(aside, sharded=is_sharded_checkpoint(aside))
    if legacy is not None and is_sharded_checkpoint(legacy):
        return Located(legacy, sharded=True)
    raise CheckpointError(f"no checkpoint at {given}: nothing is there (check the path, and that the save finished)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
