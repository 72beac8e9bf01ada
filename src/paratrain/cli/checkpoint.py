"""``paratrain checkpoint consolidate DIR OUT.pt``: a checkpoint (sharded or not) as one plain torch file."""

from __future__ import annotations

import argparse

__all__ = ["add_checkpoint_parser"]


def add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    checkpoint = commands.add_parser("checkpoint", help="work with checkpoints: consolidate one into a plain file")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    consolidate = actions.add_parser(
        "consolidate",
        help="write a checkpoint (a sharded directory or a file) as a plain torch state dict, for export",
    )
    consolidate.add_argument("source", metavar="CHECKPOINT", help="a checkpoint directory or file")
    consolidate.add_argument("out", metavar="OUT.pt", help="where the plain state dict goes")
    consolidate.add_argument("--all", action="store_true", help="the whole training state, not only the model's")
    consolidate.set_defaults(handler=_consolidate)


def _consolidate(args: argparse.Namespace) -> int:
    from paratrain.checkpoint.consolidate import consolidate

    state = consolidate(args.source, args.out, everything=args.all)
    tensors = [v for v in state.values() if hasattr(v, "numel")]
    what = "training state" if args.all else "model state dict"
    print(f"wrote {args.out}: the {what}, {len(state)} entries, {sum(t.numel() for t in tensors):,} elements")
    return 0
