"""A checkpoint in torch's distributed checkpoint format: ``paratrain checkpoint export --format dcp DIR OUT``.

    export_dcp("runs/a/epoch-0004-step-000000", "dcp/step-4")      # {"model": ..., "optimizer": ...}
    dcp.load({"model": model.state_dict()}, checkpoint_id="dcp/step-4")          # torch reads it back
    set_model_state_dict / dcp.load into an FSDP2 model at any world size

The model's state dict goes under ``model``; the optimizer's (when the checkpoint has one) under ``optimizer``,
keyed by parameter names as torch's ``get_optimizer_state_dict`` lays it out (``state`` -> ``{fqn: {exp_avg,
step, ...}}``, each group's ``params`` a list of FQNs; :mod:`paratrain.checkpoint.optimizer_names` says how the
names are found). It is written by this one process (``torch.distributed.checkpoint.save`` without a process
group) into a hidden directory beside ``OUT``, renamed into place once complete, as paratrain's own checkpoints.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.checkpoint.consolidate import find_checkpoint
from paratrain.checkpoint.optimizer_names import optimizer_fqns, optimizer_state_by_name
from paratrain.checkpoint.sharded import materialize, read_plain
from paratrain.errors import CheckpointError, ConfigError
from paratrain.files import check_output

__all__ = ["DCP_METADATA", "Exported", "export_dcp", "is_dcp_checkpoint"]

DCP_METADATA = ".metadata"  # what FileSystemWriter writes last: a directory with it is a DCP checkpoint


def is_dcp_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


@dataclass
class Exported:
    """What :func:`export_dcp` wrote: the state (``model``, maybe ``optimizer``), and why an optimizer is not in
    it (None when it is)."""

    state: dict[str, Any]
    optimizer_left_out: str | None = None


def export_dcp(source: str | Path, out: str | Path, *, model_only: bool = False) -> Exported:
    """Write ``source``'s model (and its optimizer's state by name, unless ``model_only``) as the DCP directory
    ``out``, replacing a DCP checkpoint there.

    Raises:
        ConfigError: ``source`` names no checkpoint; ``out`` is a file, a directory that is no DCP checkpoint, or
            cannot be written.
        CheckpointError: ``source`` is damaged or has no model; its optimizer's parameters cannot be named (see
            :func:`~paratrain.checkpoint.optimizer_names.optimizer_fqns`).
    """
    target = Path(out)
    _check_target(target)
    source, _ = find_checkpoint(source)
    state = materialize(read_plain(source))
    if "model" not in state:
        raise CheckpointError(f"{source} has no 'model' entry (keys: {', '.join(map(str, state))}): nothing to export")
    exported: dict[str, Any] = {"model": state["model"]}
    left_out = None
    if model_only:
        left_out = "--model-only"
    elif not isinstance(state.get("optimizer"), dict):
        left_out = "the checkpoint has none"
    else:
        names = optimizer_fqns(state["model"], state["optimizer"], state.get("parameter_names"))
        exported["optimizer"] = optimizer_state_by_name(state["optimizer"], names)
    _write(exported, target)
    return Exported(exported, left_out)


def _check_target(target: Path) -> None:
    if target.is_dir():
        if is_dcp_checkpoint(target) or not any(target.iterdir()):
            check_output(target / ".paratrain-check", "OUT")
            return
        raise ConfigError(
            f"OUT {target} is a directory that holds other things than a DCP checkpoint; give a new directory"
        )
    if target.exists():
        raise ConfigError(f"OUT {target} is a file; a DCP checkpoint is a directory: give a new directory's path")
    check_output(target, "OUT")


def _write(state: dict[str, Any], target: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that crashed
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            save(state, storage_writer=FileSystemWriter(str(partial)), no_dist=True)
        replaced = target.parent / f".{target.name}.replaced"
        if target.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(target, replaced)
        os.replace(partial, target)
        shutil.rmtree(replaced, ignore_errors=True)
    except OSError as exc:
        raise CheckpointError(
            f"could not write {target} ({exc.strerror or exc}); check free space and permissions"
        ) from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
