"""torchrun's variables, read in one place into one frozen object (as Lightning Fabric's ``ClusterEnvironment``).

A worker started by a launcher (``paratrain launch``, torchrun, ``python -m torch.distributed.run``) learns its
place in the job from environment variables: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID and TORCHELASTIC_USE_AGENT_STORE. This
module is the only one in paratrain that reads them; everything else receives a :class:`ClusterEnvironment`::

    env = ClusterEnvironment.detect()
    if env.launched:                           # False in a process no launcher started: rank 0 of 1
        env.rank, env.local_rank, env.world_size, env.restart_count
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["ClusterEnvironment", "launched_by_torchrun"]

# the variables every torchrun worker has: without all of them, no launcher started this process
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process sits in a launched job, as its launcher told it (rank 0 of 1 without a launcher)."""

    launched: bool = False  # a launcher started this process: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* are set
    rank: int = 0  # among every process of the job
    local_rank: int = 0  # among this machine's processes: the GPU it takes
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0  # torchrun's GROUP_RANK: this machine's place among the machines
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # how often the launcher restarted this worker's group (0: the first attempt)
    run_id: str | None = None  # the job's id, the same on every machine and across restarts
    agent_store: bool = False  # the workers meet in the launcher's own store (torchrun's default)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
        """The environment a launcher set for this process (``environ``: default ``os.environ``).

        Raises:
            ConfigError: the variables are there but malformed (not integers, a rank outside the world).
        """
        values = os.environ if environ is None else environ
        restarts = values.get("TORCHELASTIC_RESTART_COUNT", "0")
        elastic = {
            "restart_count": int(restarts) if restarts.isdigit() else 0,
            "run_id": values.get("TORCHELASTIC_RUN_ID") or None,
            "agent_store": values.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        }
        if not all(name in values for name in _REQUIRED):
            return cls(**elastic)  # type: ignore[arg-type]
        rank, world_size = _int(values, "RANK"), _int(values, "WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world_size}; the launcher's variables are broken")
        local_world_size = _int(values, "LOCAL_WORLD_SIZE", default=world_size)
        return cls(
            launched=True,
            rank=rank,
            local_rank=_int(values, "LOCAL_RANK"),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(values, "GROUP_RANK", default=rank // max(local_world_size, 1)),
            master_addr=values["MASTER_ADDR"],
            master_port=_int(values, "MASTER_PORT"),
            **elastic,  # type: ignore[arg-type]
        )


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker process started by a launcher (torchrun's variables are set)."""
    return ClusterEnvironment.detect(environ).launched


def _int(values: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = values.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={text!r} is not an integer; the launcher's variables are broken") from None
