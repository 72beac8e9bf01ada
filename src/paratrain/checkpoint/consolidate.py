"""A checkpoint as one plain torch file, for export: ``paratrain checkpoint consolidate DIR OUT.pt``.

    consolidate("runs/a/epoch-0004-step-000000", "model.pt")              # the model's state dict
    consolidate("runs/a/epoch-0004-step-000000", "all.pt", everything=True) # the whole training state
    model.load_state_dict(torch.load("model.pt", weights_only=True))

It reads any checkpoint paratrain writes (a file, or a sharded checkpoint's directory, whatever wrote it), checks
every slice's digest on the way, and writes the state a single process would have saved, atomically. Resuming
needs no such step: every strategy reads sharded checkpoints as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.sharded import materialize, read_plain
from paratrain.errors import CheckpointError
from paratrain.files import atomic_writer, check_output

__all__ = ["consolidate"]


def consolidate(source: str | Path, out: str | Path, *, everything: bool = False) -> dict[str, Any]:
    """Write ``source``'s model state dict (``everything``: its whole state) to ``out`` with ``torch.save``.

    Returns what was written.

    Raises:
        CheckpointError: ``source`` is no checkpoint, is damaged, or has no model.
        ConfigError: ``out`` cannot be written.
    """
    check_output(out, "OUT")
    state = materialize(read_plain(source))
    if not everything:
        if "model" not in state:
            raise CheckpointError(
                f"{source} has no 'model' entry (keys: {', '.join(map(str, state))}); write the whole state with "
                f"--all instead"
            )
        state = state["model"]
    with atomic_writer(Path(out), "wb", durable=True) as stream:
        torch.save(state, stream)
    written: dict[str, Any] = state
    return written
