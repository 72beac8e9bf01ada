"""What a user pastes into a bug report (``paratrain env``): versions, accelerators, distributed backends.

report = collect()
print(report.render())           # or report.as_dict() for JSON
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError
from paratrain.version import __version__

__all__ = ["Accelerator", "EnvReport", "collect"]


@dataclass(frozen=True)
class Accelerator:
    index: int
    name: str
    memory_gib: float
    capability: str


@dataclass(frozen=True)
class EnvReport:
    paratrain: str
    python: str
    platform: str
    torch: str
    cuda_build: str | None
    cudnn: int | None
    cpu_threads: int
    accelerators: list[Accelerator] = field(default_factory=list)
    backends: dict[str, bool] = field(default_factory=dict)
    # what started this process (ClusterEnvironment.scheduler, or "error" with the reason) and what it read
    scheduler: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        lines = [
            f"paratrain      {self.paratrain}",
            f"python         {self.python}",
            f"platform       {self.platform}",
            f"torch          {self.torch}",
            f"cuda (build)   {self.cuda_build or 'none (CPU build)'}",
            f"cudnn          {self.cudnn if self.cudnn is not None else 'none'}",
            f"cpu threads    {self.cpu_threads}",
        ]
        if self.accelerators:
            lines.append(f"gpus           {len(self.accelerators)}")
            lines.extend(
                f"  cuda:{a.index}  {a.name}  {a.memory_gib:.1f} GiB  compute {a.capability}" for a in self.accelerators
            )
        else:
            lines.append("gpus           none visible (DataParallel can still use CPU replicas)")
        backends = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in self.backends.items())
        lines.append(f"distributed    {backends}")
        lines += _render_scheduler(self.scheduler)
        return "\n".join(lines)


def _render_scheduler(found: dict[str, Any]) -> list[str]:
    name = found.get("name", "none")
    if name == "none":
        return ["started by     nothing (a single process; paratrain launch, torchrun, srun or mpirun start ranks)"]
    if name == "error":
        return [f"started by     unreadable: {found['error']}"]
    place = (
        f"rank {found['rank']} of {found['world_size']}, local rank {found['local_rank']} of "
        f"{found['local_world_size']}, node {found['node_rank']}, rendezvous {found['master_addr']}:"
        f"{found['master_port']}"
    )
    lines = [f"started by     {name}: {place}"]
    lines += [f"  {variable}={value}" for variable, value in found["read"].items()]
    return lines


def _scheduler() -> dict[str, Any]:
    """What started this process and what it read; a contradiction is reported, not raised (a bug report)."""
    try:
        env = ClusterEnvironment.detect()
    except ConfigError as e:
        return {"name": "error", "error": str(e)}
    if not env.launched:
        return {"name": "none"}
    fields = ("rank", "world_size", "local_rank", "local_world_size", "node_rank", "master_addr", "master_port")
    return {"name": env.scheduler, **{f: getattr(env, f) for f in fields}, "read": dict(env.read)}


def _accelerators() -> list[Accelerator]:
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        found.append(Accelerator(i, props.name, props.total_memory / 2**30, f"{props.major}.{props.minor}"))
    return found


def _backends() -> dict[str, bool]:
    if not dist.is_available():
        return {"torch.distributed": False}
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def collect() -> EnvReport:
    """Read the report off this machine."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return EnvReport(
        paratrain=__version__,
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        cuda_build=torch.version.cuda,
        cudnn=cudnn,
        cpu_threads=torch.get_num_threads(),
        accelerators=_accelerators(),
        backends=_backends(),
        scheduler=_scheduler(),
    )
