"""``paratrain checkpoint consolidate DIR OUT.pt``: a checkpoint (sharded or not) as one plain torch file."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_checkpoint_parser"]


def add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    checkpoint = commands.add_parser("checkpoint", help="work with checkpoints: consolidate one into a plain file")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    consolidate = actions.add_parser(
        "consolidate",
        help="write a checkpoint (a sharded directory or a file) as a plain torch state dict, for export",
    )
    consolidate.add_argument(
        "source",
        metavar="CHECKPOINT",
        help="a checkpoint file, a sharded checkpoint's directory (or the .pt path it was saved to), or a run's "
        "--checkpoint-dir (its latest checkpoint)",
    )
    consolidate.add_argument("out", metavar="OUT.pt", help="where the plain state dict goes")
    consolidate.add_argument("--all", action="store_true", help="the whole training state, not only the model's")
    consolidate.set_defaults(handler=_consolidate)


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from paratrain.checkpoint.consolidate import consolidate, find_checkpoint
    from paratrain.tree import flatten

    source, found = find_checkpoint(args.source)
    if found is not None:
        print(f"paratrain checkpoint consolidate: {found}", file=sys.stderr, flush=True)
    state = consolidate(source, args.out, everything=args.all)
    tensors = [leaf for leaf in flatten(state)[0] if isinstance(leaf, torch.Tensor)]  # the optimizer's are nested
    elements = sum(t.numel() for t in tensors)
    what = f"training state ({', '.join(map(str, state))})" if args.all else "model state dict"
    print(f"wrote {args.out}: the {what}, {len(tensors)} tensors, {elements:,} elements")
    return 0
