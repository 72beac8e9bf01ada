"""``paratrain bench``: samples/s, speed-up and efficiency of every configuration. Flags from BenchConfig.

paratrain bench                                            # every configuration this machine can run
paratrain bench --model mlp --width 2048 --configs single ddp:2 --report-out bench.json   # + bench.md, bench.png
"""

from __future__ import annotations

import argparse

from .options import from_args
from .tools_common import add_settings_options, finish_report

__all__ = ["add_bench_parser"]


def add_bench_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ..tools.bench import BenchConfig

    parser = commands.add_parser(
        "bench",
        help="measure samples/s, speed-up and efficiency of every configuration, with a time breakdown",
        description="Time each configuration (warm-up, then timed steps, repeated round robin), split each step "
        "into data wait, forward, backward with the synchronisation it does not hide, and optimizer; report "
        "medians, samples/s, speed-up and efficiency against single. Writes JSON, Markdown and a PNG plot.",
    )
    add_settings_options(parser, BenchConfig)
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from ..tools.bench import BenchConfig, bench

    config = from_args(BenchConfig, args)
    config.validate_settings()
    return finish_report(bench(config), config.report_out)
