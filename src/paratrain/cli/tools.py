"""``paratrain verify``, ``bench`` and ``plan``: one table of the three tools, their flags from each settings class.

paratrain verify                                           # every configuration this machine can run
paratrain verify --model mypkg.nets:make --input-shape 3,32,32 --configs single dp:cpu,cpu ddp:2
paratrain bench --model mlp --width 2048 --configs single ddp:2 --report-out bench.json   # + bench.md, bench.png
paratrain plan --max-world-size 8                          # measured on this machine, in seconds
paratrain plan --model mlp --width 2048 --validate         # and the prediction error against bench, here

Each prints its report and exits 0 when it passes, 1 when a finding fails the check (a configuration that
differs or fails to run, a prediction error past --max-error), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any

from paratrain.cli.config import add_config_options
from paratrain.cli.options import add_options, from_args

__all__ = ["TOOLS", "add_tool_parsers"]


@dataclass(frozen=True)
class Tool:
    """One tool: its command, where its settings class and function live, and its help."""

    command: str
    module: str  # holds the settings class and the function of the same name as the command
    settings: str
    help: str
    description: str


TOOLS = (
    Tool(
        "verify",
        "paratrain.tools.verify",
        "VerifyConfig",
        "check that every parallel configuration gives one device's losses, gradients and parameters",
        "Run each configuration for a few optimizer steps from the same weights on the same global batches and "
        "compare the loss, every synchronised gradient and every parameter with single. Names the first "
        "parameter that diverges (in forward order) and the likely cause. Exit 0 when all pass, 1 when one "
        "differs or fails to run, 2 on a usage error. Configurations this machine cannot run are SKIPPED.",
    ),
    Tool(
        "bench",
        "paratrain.tools.bench",
        "BenchConfig",
        "measure samples/s, speed-up and efficiency of every configuration, with a time breakdown",
        "Time each configuration (warm-up, then timed steps, repeated round robin), split each step into data "
        "wait, forward, backward with the synchronisation it does not hide, and optimizer; report each repeat's mean "
        "step (its throughput) and the median over repeats, "
        "samples/s, speed-up and efficiency against single. Writes JSON, Markdown and a PNG plot.",
    ),
    Tool(
        "plan",
        "paratrain.tools.plan",
        "PlanConfig",
        "predict ddp's step time, samples/s and efficiency at 1..N devices before renting them",
        "Run the real job (single, ddp:N in launched workers, at the threads train gives each) for a few steps "
        "at the world sizes this machine can run: those rows are measured. Beyond them, extrapolate from a model "
        "(compute on one device, when each gradient is ready, the all-reduce between real processes or the link "
        "given between machines, our DDP's overlapped buckets) fitted to those runs, with the fit's error at the "
        "measured sizes. Prints one row per world size, the assumptions, whether a longer --budget would change "
        "the answer, and the world size past which devices stop paying; a line per phase on stderr. --validate "
        "runs bench here and prints "
        "the prediction error (exit 1 when one exceeds --max-error).",
    ),
)


def add_tool_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """One subcommand per tool, its flags generated from the tool's settings class."""
    for tool in TOOLS:
        parser = commands.add_parser(tool.command, help=tool.help, description=tool.description)
        settings = getattr(importlib.import_module(tool.module), tool.settings)
        add_options(parser, settings)
        add_config_options(parser, (settings,), tool.command)
        parser.set_defaults(handler=lambda args, tool=tool: _run(tool, args))


def _run(tool: Tool, args: argparse.Namespace) -> int:
    module = importlib.import_module(tool.module)
    config = from_args(getattr(module, tool.settings), args)
    config.check()
    report: Any = getattr(module, tool.command)(config)
    print(report.render())
    if report.written:
        print(f"\nwrote {', '.join(report.written)}")
    return 0 if report.ok else 1
