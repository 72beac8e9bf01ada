"""The ``paratrain`` command: argument parsing only; every command calls the library.

paratrain env                             # versions, GPUs, distributed backends
paratrain demo --devices cpu,cpu,cpu      # the first seed's DataParallel demo
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import demo, env_info
from .argtypes import non_negative_int, positive_float, positive_int
from .cli_launch import add_launch_parser, add_launcher_options, launch_config, report_exit
from .datasets import DATASET_NAMES
from .devices import parse_devices_arg
from .errors import ConfigError, ParatrainError
from .models import MODEL_NAMES
from .strategies import STRATEGY_NAMES
from .version import __version__

__all__ = ["build_parser", "main"]

EXIT_RUNTIME = 1
EXIT_USAGE = 2


def _add_train(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tr = commands.add_parser(
        "train",
        help="train a model (default: the second seed's SimpleNet job) on one device or many",
        description="Train with the second seed's settings by default: SimpleNet, digits, 5 epochs, batch 64, "
        "SGD lr 0.01. --batch-size is the global batch under every strategy.",
    )
    tr.add_argument("--model", default="simplenet", choices=MODEL_NAMES)
    tr.add_argument("--dataset", default="digits", choices=DATASET_NAMES)
    tr.add_argument("--epochs", type=positive_int, default=5)
    tr.add_argument("--batch-size", type=positive_int, default=64, help="global batch size (default 64)")
    tr.add_argument("--lr", type=positive_float, default=0.01, help="SGD learning rate (default 0.01)")
    tr.add_argument("--log-every", type=positive_int, default=100, help="print the loss every N steps")
    tr.add_argument("--strategy", default="auto", choices=STRATEGY_NAMES)
    tr.add_argument("--devices", default="auto", help="auto, cpu, cuda, cuda:0,cuda:1, cpu,cpu,cpu (CPU replicas)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--data-dir", help="where the mnist IDX files are (or get downloaded to)")
    tr.add_argument("--checkpoint-dir", help="save a checkpoint there at the end of every epoch")
    tr.add_argument(
        "--checkpoint-every",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also save every N steps (default: only at epoch ends)",
    )
    tr.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=3,
        metavar="K",
        help="keep the newest K checkpoints (default 3)",
    )
    tr.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="latest|if-exists|PATH",
        help="continue from the latest checkpoint in --checkpoint-dir (an error if there is none), "
        "from it only if one exists (if-exists), or from a given file",
    )
    tr.add_argument("--metrics-out", metavar="FILE.json", help="write the results as JSON")
    tr.add_argument("--quiet", action="store_true", help="no progress bar and no per-step lines")
    tr.add_argument("--width", type=positive_int, default=1024, help="hidden width of --model mlp")
    tr.add_argument("--depth", type=non_negative_int, default=2, help="hidden layers of --model mlp")
    tr.add_argument("--max-steps", type=positive_int, metavar="N", help="stop after N steps (smoke runs)")
    tr.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        metavar="SECONDS",
        help="ddp: how long a collective may wait for the other ranks before failing (default 300)",
    )
    add_launcher_options(tr)
    tr.set_defaults(handler=_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Take a PyTorch training loop from one device to many."
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    _add_train(commands)
    add_launch_parser(commands)

    env = commands.add_parser("env", help="versions, GPUs and distributed backends, for bug reports")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(handler=_env)

    dm = commands.add_parser("demo", help="the first seed's DataParallel demo: how each batch is split")
    dm.add_argument("--devices", default="auto", help="auto (every GPU, or cpu,cpu without one), cpu,cpu,cpu, 0,1, ...")
    dm.add_argument("--batch-size", type=positive_int, default=30)
    dm.add_argument("--data-size", type=positive_int, default=100)
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(handler=_demo)
    return parser


def _env(args: argparse.Namespace) -> int:
    report = env_info.collect()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0


def _demo(args: argparse.Namespace) -> int:
    devices = parse_devices_arg(args.devices) or demo.default_demo_devices()
    demo.run_demo(devices, batch_size=args.batch_size, data_size=args.data_size, seed=args.seed)
    return 0


def _train(args: argparse.Namespace) -> int:
    from .devices import visible_gpus
    from .strategies import launched_by_torchrun
    from .train import TrainConfig, train  # the training stack is only imported when needed

    wants_processes = args.strategy == "ddp" or (
        args.strategy == "auto" and args.devices in ("auto", "cuda") and len(visible_gpus()) > 1
    )
    if wants_processes and not launched_by_torchrun():
        # this process becomes the launcher; every worker runs this same command under torchrun
        from .launch import launch

        code = launch(launch_config(args), "paratrain", ["train", *args.argv], module=True)
        return report_exit(code, "train")
    config = TrainConfig(
        model=args.model,
        dataset=args.dataset,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        log_every=args.log_every,
        strategy=args.strategy,
        devices=args.devices,
        seed=args.seed,
        data_dir=args.data_dir,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        resume=args.resume,
        metrics_out=args.metrics_out,
        quiet=args.quiet,
        width=args.width,
        depth=args.depth,
        max_steps=args.max_steps,
        timeout=args.timeout,
    )
    train(config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 runtime error, 2 usage error)."""
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    # what followed the subcommand, so `train --strategy ddp` can start its workers with the same arguments
    args.argv = raw[raw.index(args.command) + 1 :] if args.command in raw else []
    try:
        code: int = args.handler(args)
        return code
    except ConfigError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ParatrainError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted", file=sys.stderr)
        return 130
