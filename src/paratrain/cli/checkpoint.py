"""``paratrain checkpoint consolidate DIR OUT`` (a plain torch or safetensors file) and ``paratrain checkpoint
export --format dcp DIR OUT`` (torch's distributed checkpoint format): a checkpoint, sharded or not, in the formats
other tools read."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_checkpoint_parser"]

_SOURCE_HELP = (
    "a checkpoint file, a sharded checkpoint's directory (or the .pt path it was saved to), or a run's "
    "--checkpoint-dir (its latest checkpoint)"
)


def add_checkpoint_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    checkpoint = commands.add_parser(
        "checkpoint", help="work with checkpoints: consolidate one into a plain file, export it as DCP"
    )
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    consolidate = actions.add_parser(
        "consolidate",
        help="write a checkpoint (a sharded directory or a file) as a plain torch state dict or a safetensors file",
        description="Write a checkpoint's model state dict (or, --all, its whole training state) as one file: "
        "torch.save's (load it with torch.load) or safetensors' (load it with safetensors.torch.load_file; the "
        "model only; needs pip install 'paratrain[safetensors]'). Either loads strictly into the plain model.",
    )
    consolidate.add_argument("source", metavar="CHECKPOINT", help=_SOURCE_HELP)
    consolidate.add_argument("out", metavar="OUT", help="the file to write (OUT.pt, OUT.safetensors)")
    consolidate.add_argument(
        "--all", action="store_true", help="the whole training state, not only the model's (--format torch only)"
    )
    consolidate.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default="torch",
        help="torch (torch.save, the default) or safetensors (tensors only: a tied weight's later names are "
        "written as copies)",
    )
    consolidate.set_defaults(handler=_consolidate)
    export = actions.add_parser(
        "export",
        help="write a checkpoint in torch's distributed checkpoint (DCP) format, for torch.distributed.checkpoint",
        description="Write a checkpoint as a torch.distributed.checkpoint directory: the model's state dict under "
        "'model', the optimizer's state keyed by parameter names under 'optimizer' (as get_optimizer_state_dict "
        "lays it out). dcp.load reads it into a plain model, or an FSDP2 model at any world size.",
    )
    export.add_argument("source", metavar="CHECKPOINT", help=_SOURCE_HELP)
    export.add_argument("out", metavar="OUT", help="the directory to write (a DCP checkpoint there is replaced)")
    export.add_argument("--format", choices=("dcp",), default="dcp", help="dcp: torch.distributed.checkpoint's")
    export.add_argument("--model-only", action="store_true", help="leave the optimizer's state out")
    export.set_defaults(handler=_export)


def _say_found(action: str, source: str) -> str:
    from paratrain.checkpoint.consolidate import find_checkpoint

    found_at, found = find_checkpoint(source)
    if found is not None:
        print(f"paratrain checkpoint {action}: {found}", file=sys.stderr, flush=True)
    return str(found_at)


def _counts(state: object) -> tuple[int, int]:
    import torch

    from paratrain.tree import flatten

    tensors = [leaf for leaf in flatten(state)[0] if isinstance(leaf, torch.Tensor)]  # the optimizer's are nested
    return len(tensors), sum(t.numel() for t in tensors)


def _consolidate(args: argparse.Namespace) -> int:
    from paratrain.checkpoint.consolidate import consolidate

    source = _say_found("consolidate", args.source)
    notes: list[str] = []
    state = consolidate(source, args.out, everything=args.all, format=args.format, log=notes.append)
    tensors, elements = _counts(state)
    what = f"training state ({', '.join(map(str, state))})" if args.all else "model state dict"
    print(f"wrote {args.out} ({args.format}): the {what}, {tensors} tensors, {elements:,} elements")
    for note in notes:
        print(f"  {note}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from paratrain.checkpoint.dcp_export import export_dcp

    source = _say_found("export", args.source)
    exported = export_dcp(source, args.out, model_only=args.model_only)
    tensors, elements = _counts(exported.state)
    keys = ", ".join(exported.state)
    print(f"wrote {args.out} (dcp): {keys}, {tensors} tensors, {elements:,} elements")
    if exported.optimizer_left_out is not None:
        print(f"  no optimizer state: {exported.optimizer_left_out}")
    else:
        names = exported.state["optimizer"]["param_groups"]
        count = sum(len(group["params"]) for group in names)
        print(f"  the optimizer's state of {count} parameters, keyed by their names (as get_optimizer_state_dict)")
    return 0
