"""``--config FILE`` and ``--print-config``: a command's settings from a TOML file, the command line overriding it.

paratrain train --config run.toml --lr 0.05     # the file's settings, with --lr from the command line
paratrain train --config run.toml --print-config > resolved.toml   # file, then flags, then defaults; exits 0

The file's keys are the command's flags without dashes (``batch-size = 128``; ``batch_size`` is taken too); see
:mod:`paratrain.config_file`. The file's values become the parser's defaults and the command line is parsed
again, so a flag given there wins over the file, and the file over the settings' own defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from paratrain.cli.options import from_args
from paratrain.config_file import read_config, to_toml

__all__ = ["add_config_options", "apply_config_file", "printed_config"]


def add_config_options(parser: argparse.ArgumentParser, classes: Sequence[type], command: str) -> None:
    """Add ``--config`` and ``--print-config`` for the settings of ``classes`` (whose flags ``parser`` has)."""
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE.toml",
        help="read settings from a TOML file, one key per flag without the dashes (batch-size = 128); flags "
        "given on the command line override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings (the file, then the flags, then the defaults) as TOML and exit; the "
        "output is a file --config takes",
    )
    parser.set_defaults(settings_parser=parser, settings_classes=tuple(classes), settings_command=command)


def apply_config_file(
    parser: argparse.ArgumentParser, raw: Sequence[str], args: argparse.Namespace
) -> argparse.Namespace:
    """``args`` again, with the ``--config`` file's settings under the command line's (``args`` without a file).

    Raises:
        ConfigError: the file cannot be read, or holds an unknown key, a wrong type or a value out of range.
    """
    path = getattr(args, "config_file", None)
    if path is None:
        return args
    args.settings_parser.set_defaults(**read_config(path, args.settings_classes))
    again, _ = parser.parse_known_args(list(raw))  # unknown arguments were refused on the first parse
    return again


def printed_config(args: argparse.Namespace) -> str:
    """The resolved settings of ``args`` as TOML, one block per settings class."""
    blocks = []
    for i, cls in enumerate(args.settings_classes):
        settings = from_args(cls, args)
        header = f"paratrain {args.settings_command} --config FILE" if i == 0 else cls.__doc__.splitlines()[0]
        blocks.append(to_toml(settings.to_dict(), header=header))
    return "\n".join(blocks)
