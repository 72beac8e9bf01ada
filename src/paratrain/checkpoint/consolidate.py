"""A checkpoint as one plain file, for export: ``paratrain checkpoint consolidate DIR OUT.pt``.

    consolidate("runs/a/epoch-0004-step-000000", "model.pt")              # the model's state dict
    consolidate("runs/a/epoch-0004-step-000000", "all.pt", everything=True) # the whole training state
    model.load_state_dict(torch.load("model.pt", weights_only=True))
    consolidate("runs/a/epoch-0004-step-000000", "model.safetensors", format="safetensors")
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

It reads any checkpoint paratrain writes (a file, or a sharded checkpoint's directory, whatever wrote it), checks
every slice's digest on the way, and writes the state a single process would have saved, atomically. Resuming
needs no such step: every strategy reads sharded checkpoints as they are. The source may also be named as it was
saved or trained into (:func:`find_checkpoint`)::

    consolidate("ckpt/zero2-final.pt", "model.pt")   # par.save(state, "ckpt/zero2-final.pt") wrote ckpt/zero2-final/
    consolidate("runs/a", "model.pt")                # a run's --checkpoint-dir: its latest checkpoint, as --resume
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.file import latest_checkpoint
from paratrain.checkpoint.formats import FORMATS, require_safetensors, write_safetensors
from paratrain.checkpoint.sharded import is_sharded_checkpoint, materialize, read_plain
from paratrain.errors import CheckpointError, ConfigError
from paratrain.files import atomic_writer, check_output

__all__ = ["consolidate", "find_checkpoint"]


def find_checkpoint(source: str | Path) -> tuple[Path, str | None]:
    """The checkpoint ``source`` names, and a sentence saying how it was found when it is not ``source`` itself.

    ``source`` is a checkpoint file or a sharded checkpoint's directory; the path a sharded checkpoint was saved
    to (``ckpt/final.pt``, for which :meth:`Parallel.save` wrote the directory ``ckpt/final``); or a run's
    checkpoint directory (``--checkpoint-dir``), whose latest checkpoint is taken, as ``--resume`` takes it.

    Raises:
        ConfigError: nothing is at ``source``, or a directory that holds no checkpoint.
    """
    path = Path(source)
    if is_sharded_checkpoint(path) or path.is_file():
        return path, None
    if not path.exists():
        directory = path.with_suffix("")
        if path.suffix == ".pt" and is_sharded_checkpoint(directory):
            return directory, (
                f"{path} is the name the sharded checkpoint {directory}{os.sep} was saved under (an earlier paratrain "
                f"wrote sharded checkpoints without .pt): reading it"
            )
        raise ConfigError(
            f"no checkpoint at {path}: nothing is there; give a checkpoint file, a sharded checkpoint's directory, "
            f"or a run's --checkpoint-dir (its latest checkpoint is taken)"
        )
    if not path.is_dir():
        raise ConfigError(f"{path} is neither a file nor a directory; give a checkpoint file or directory")
    latest = latest_checkpoint(path)
    if latest is None:
        inside = sorted(p.name + (os.sep if p.is_dir() else "") for p in path.iterdir() if _may_be_one(p))
        found = f"; it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}: give one" if inside else ""
        raise ConfigError(
            f"{path} holds no checkpoint a run writes (epoch-E-step-S.pt files, or sharded epoch-E-step-S "
            f"directories) and is no sharded checkpoint itself{found}"
        )
    return latest, f"{path} is a run's checkpoint directory: reading its latest checkpoint, {latest}"


def _may_be_one(path: Path) -> bool:
    return is_sharded_checkpoint(path) or (path.suffix == ".pt" and path.is_file())


def consolidate(
    source: str | Path,
    out: str | Path,
    *,
    everything: bool = False,
    format: str = "torch",
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write ``source``'s model state dict (``everything``: its whole state) to ``out``: with ``torch.save``, or
    (``format="safetensors"``, the model only) as safetensors (:mod:`paratrain.checkpoint.formats`).

    ``source`` is found as :func:`find_checkpoint` finds it. Returns what was written; ``log`` receives a line for
    each tensor written as a copy (safetensors: a tied weight's later names, a non-contiguous tensor).

    Raises:
        ConfigError: ``source`` names no checkpoint, ``out`` cannot be written, an unknown format, safetensors
            asked for without the package, with ``everything``, or for a state holding other values than tensors.
        CheckpointError: ``source`` is no paratrain checkpoint, is damaged, or has no model.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown format {format!r}; choose one of: {', '.join(FORMATS)}")
    if format == "safetensors":
        require_safetensors()
        if everything:
            raise ConfigError(
                "--all with --format safetensors: safetensors stores named tensors only, and the training state "
                "also holds numbers, settings and nested optimizer state; write the model alone (drop --all), or "
                "the whole state with --format torch"
            )
    check_output(out, "OUT")
    source, _ = find_checkpoint(source)
    state = materialize(read_plain(source))
    if not everything:
        if "model" not in state:
            raise CheckpointError(
                f"{source} has no 'model' entry (keys: {', '.join(map(str, state))}); write the whole state with "
                f"--all instead"
            )
        state = state["model"]
    if format == "safetensors":
        for note in write_safetensors(state, out):
            if log is not None:
                log(note)
    else:
        with atomic_writer(Path(out), "wb", durable=True) as stream:
            torch.save(state, stream)
    written: dict[str, Any] = state
    return written
