"""What a training run ran with, written beside its outputs so that it can be read, compared and repeated.

    invocation = Invocation.now(config, par, resumed_from=None, start_step=0)
    invocation.write("runs/a")     # runs/a/paratrain-run.toml (the settings) and runs/a/paratrain-run.json

``paratrain-run.toml`` is the run's resolved settings in the format ``--config`` reads (with the launcher's,
``nproc-per-node`` and the rest, when ``paratrain train`` started the ranks), its header comments the
environment. It holds the run's settings, not one invocation's limits: ``max-steps`` (where this invocation
stopped itself) and ``resume`` (how it started) are left out, so that ``paratrain train --config
runs/a/paratrain-run.toml --resume`` continues the whole run instead of stopping again after as many steps. The
header says how to repeat the invocation: ``paratrain train --config runs/a/paratrain-run.toml`` (with
``--max-steps N`` where it had one) runs the same job again, and on the same machine and software reaches the
same ``model_fingerprint`` (a test holds it to that).
``paratrain-run.json`` lists every invocation of the run in order, each with its settings, its environment and
where it resumed from: a resumed run appends itself to the record the run's first invocation started.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.config_file import to_toml
from paratrain.errors import ConfigError
from paratrain.files import atomic_writer
from paratrain.launch.config import LaunchConfig
from paratrain.parallel import Parallel
from paratrain.training.config import TrainConfig
from paratrain.version import __version__

__all__ = ["INVOCATION_ONLY", "RECORD_JSON", "RECORD_TOML", "Invocation", "environment"]

RECORD_TOML = "paratrain-run.toml"
RECORD_JSON = "paratrain-run.json"
# settings of one invocation, not of the run: paratrain-run.toml leaves them out (paratrain-run.json keeps them)
INVOCATION_ONLY = ("max_steps", "resume")


def environment(par: Parallel) -> dict[str, Any]:
    """The software and hardware a run ran on: versions, devices, world size, backend."""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "paratrain": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,  # the build's; None for a CPU build
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",  # platform() runs uname -p
        "host": platform.node(),
        "strategy": par.strategy_name,
        "devices": par.world_devices(),
        "gpus": gpus,
        "world_size": par.world_size,
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "precision": par.precision.name,
    }


@dataclass(frozen=True)
class Invocation:
    """One invocation of a run: the settings, the environment, and where it started."""

    config: dict[str, Any]
    environment: dict[str, Any]
    resumed_from: str | None  # the checkpoint this invocation continued from; None for a fresh start
    start_step: int  # optimizer steps the run had done when this invocation began
    started_at: str  # UTC, ISO 8601
    launch: dict[str, Any] | None = None  # the launcher's settings, when paratrain train started the processes

    @classmethod
    def now(
        cls,
        config: TrainConfig,
        par: Parallel,
        *,
        resumed_from: str | None,
        start_step: int,
        launcher: LaunchConfig | None = None,
    ) -> Invocation:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        launch = launcher.to_dict() if launcher is not None else None
        return cls(config.to_dict(), environment(par), resumed_from, start_step, started, launch)

    def toml(self) -> str:
        """The settings as ``--config`` reads them, the environment and the start in the header's comments."""
        env = self.environment
        gpus = f", GPUs {', '.join(env['gpus'])}" if env["gpus"] else ""
        start = f"resumed from {self.resumed_from} at step {self.start_step}" if self.resumed_from else "a fresh run"
        limit = self.config.get("max_steps")
        repeat = f"repeat it: paratrain train --config {RECORD_TOML}"
        if limit is not None:
            repeat += f" --max-steps {limit}  (this invocation's limit, not the run's)"
        if self.config.get("checkpoint_dir") is not None:
            repeat += f"\ncontinue it: paratrain train --config {RECORD_TOML} --resume"
        header = (
            f"paratrain train settings, {start}, started {self.started_at}\n"
            f"{repeat}\n"
            f"paratrain {env['paratrain']}, torch {env['torch']}, Python {env['python']}, "
            f"CUDA {env['cuda'] or 'none'}\n"
            f"{env['strategy']} on {', '.join(env['devices'])} (world size {env['world_size']}, backend "
            f"{env['backend'] or 'none'}){gpus}"
        )
        run_settings = {**self.config, **dict.fromkeys(INVOCATION_ONLY)}
        text = TrainConfig(**run_settings).to_toml(header=header)
        if self.launch is not None:  # the processes paratrain train started: the same number again
            text += "\n" + to_toml(self.launch, header="processes and machines (torchrun), as this run's were started")
        return text

    def write(self, directory: str | Path) -> None:
        """Write ``paratrain-run.toml`` and add this invocation to ``paratrain-run.json`` in ``directory``.

        A fresh run starts a new record; a resumed one appends to the one there.

        Raises:
            ConfigError: the directory cannot be written.
        """
        folder = Path(directory)
        invocations: list[dict[str, Any]] = []
        previous = folder / RECORD_JSON
        if self.resumed_from is not None and previous.is_file():
            try:
                invocations = list(json.loads(previous.read_text())["invocations"])
            except (OSError, ValueError, KeyError, TypeError):
                invocations = []  # a damaged record is replaced: the checkpoint holds the run's state
        invocations.append(asdict(self))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with atomic_writer(folder / RECORD_TOML, "w") as f:
                f.write(self.toml())
            with atomic_writer(previous, "w") as f:
                json.dump({"invocations": invocations}, f, indent=2)
                f.write("\n")
        except OSError as exc:
            raise ConfigError(f"cannot write the run record in {folder}: {exc.strerror or exc}") from exc
