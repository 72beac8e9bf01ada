"""Parallel configurations written one way everywhere: the words after ``--configs``.

single                one device (cuda:0 on a GPU machine, else the CPU); single:cuda:1 names it
dp:cpu,cpu,cpu        paratrain's DataParallel over those devices, in this process
dp:cuda:0,cuda:1
ddp:2                 2 processes started through paratrain's launcher (one GPU each, or gloo on the CPU)
zero1:2, zero2:3      as ddp:N, with the optimizer state (zero1) or also the gradients (zero2) sharded
zero3:2               as ddp:N, with the weights, gradients and optimizer state all sharded (fully sharded)

configs = parse_configs(["single", "dp:cpu,cpu", "ddp:2", "zero2:2"])
why_not = unavailable_reason(configs[1])      # None when this machine can run it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paratrain.devices import visible_gpus
from paratrain.errors import ConfigError

__all__ = [
    "MAX_DEFAULT_DEVICES",
    "PROCESSES",
    "RunConfig",
    "default_configs",
    "parse_config",
    "parse_configs",
    "unavailable_reason",
]

MAX_DEFAULT_DEVICES = 3  # the default list stops at 3 devices: enough to see unequal shares and scaling
_EXAMPLES = "single, dp:cpu,cpu,cpu, dp:cuda:0,cuda:1, ddp:2, zero1:2, zero2:2, zero3:2"
PROCESSES = ("ddp", "zero1", "zero2", "zero3")  # the configurations that run N processes


@dataclass(frozen=True)
class RunConfig:
    """One way of running: ``strategy`` with its ``devices`` (single, dp) or ``processes`` (ddp, zero1-3)."""

    word: str  # as the user wrote it, canonical: what reports show
    strategy: str  # single, dp, ddp, zero1, zero2 or zero3
    devices: tuple[str, ...] = ()  # single and dp
    processes: int = 1  # ddp, zero1, zero2, zero3

    @property
    def device_count(self) -> int:
        """How many devices (replicas or processes) share each global batch."""
        return self.processes if self.strategy in PROCESSES else len(self.devices)

    @property
    def in_process(self) -> bool:
        return self.strategy not in PROCESSES


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def parse_config(word: str) -> RunConfig:
    """One ``--configs`` word.

    Raises:
        ConfigError: a word that is none of the forms in the module docstring.
    """
    text = word.strip()
    kind, _, rest = text.partition(":")
    if kind == "single":
        device = rest or _default_device()
        _devices(device, text, expect_one=True)
        return RunConfig(f"single:{device}" if rest else "single", "single", (device,))
    if kind == "dp" and rest:
        devices = _devices(rest, text, expect_one=False)
        if len(devices) < 2:
            raise ConfigError(f"configuration {word!r}: dp needs at least two devices, e.g. dp:cpu,cpu")
        return RunConfig(f"dp:{','.join(devices)}", "dp", tuple(devices))
    if kind in PROCESSES and rest:
        if not rest.isdigit() or int(rest) < 1:
            raise ConfigError(f"configuration {word!r}: {kind}:N takes a number of processes N >= 1, e.g. {kind}:2")
        return RunConfig(f"{kind}:{int(rest)}", kind, processes=int(rest))
    raise ConfigError(f"unknown configuration {word!r}; expected words such as {_EXAMPLES}")


def _devices(text: str, word: str, *, expect_one: bool) -> list[str]:
    """The device names in ``text``, checked for form only: whether they exist here is
    :func:`unavailable_reason`'s question, so that a GPU configuration on a CPU machine is skipped, not an error."""
    parts = [p.strip() for p in text.split(",")]
    names = []
    for part in parts:
        try:
            device = torch.device(f"cuda:{part}" if part.isdigit() else part)
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ConfigError(f"configuration {word!r}: {part!r} is not a device; expected cpu, cuda:N or N")
        names.append("cpu" if device.type == "cpu" else f"cuda:{device.index or 0}")
    if expect_one and len(names) != 1:
        raise ConfigError(f"configuration {word!r}: single runs on one device; use dp:{text} for several")
    if len({n.split(":")[0] for n in names}) > 1:
        raise ConfigError(f"configuration {word!r}: dp devices must all be GPUs or all be the CPU")
    return names


def parse_configs(words: Sequence[str] | None) -> list[RunConfig]:
    """The configurations named by ``words`` (None: :func:`default_configs`), without repeats, in order."""
    if words is None:
        return default_configs()
    if isinstance(words, str):
        words = words.split()
    configs: list[RunConfig] = []
    for word in words:
        config = parse_config(word)
        if config not in configs:
            configs.append(config)
    if not configs:
        raise ConfigError(f"--configs needs at least one configuration, such as {_EXAMPLES}")
    return configs


def default_configs() -> list[RunConfig]:
    """Every configuration this machine can run, up to :data:`MAX_DEFAULT_DEVICES` devices.

    On the CPU: single, dp over 2 and 3 CPU replicas, ddp with 2 and 3 processes; with GPUs, the same over
    GPUs (as many as there are, up to the limit).
    """
    gpus = [str(d) for d in visible_gpus()]
    if gpus:
        counts = range(2, min(len(gpus), MAX_DEFAULT_DEVICES) + 1)
        dp = [f"dp:{','.join(gpus[:n])}" for n in counts]
        ddp = [f"ddp:{n}" for n in counts]
    else:
        counts = range(2, MAX_DEFAULT_DEVICES + 1)
        dp = [f"dp:{','.join(['cpu'] * n)}" for n in counts]
        ddp = [f"ddp:{n}" for n in counts]
    return [parse_config(word) for word in ["single", *dp, *ddp]]


def unavailable_reason(config: RunConfig) -> str | None:
    """Why this machine cannot run ``config`` (None when it can)."""
    gpus = len(visible_gpus())
    if config.strategy in PROCESSES:
        # without GPUs every process runs on the CPU over gloo; with GPUs, one GPU per process
        if gpus and config.processes > gpus:
            return f"needs {config.processes} GPUs (one per process), {gpus} visible"
        return None
    for device in config.devices:
        d = torch.device(device)
        if d.type == "cuda":
            if not torch.cuda.is_available():
                return "no CUDA device is visible on this machine"
            if (d.index or 0) >= gpus:
                return f"{device} does not exist: {gpus} GPU(s) visible"
        elif d.type != "cpu":
            return f"{device}: only cpu and cuda devices are supported"
    return None
