"""Where this process sits in a job, read in one place into one frozen object (as Lightning Fabric's environments).

A process learns its place in a job from the variables whatever started it set: torchrun (and ``paratrain
launch``), SLURM's ``srun``, a Kubeflow PyTorchJob's pod, or ``mpirun`` (OpenMPI's or MPICH's). This module is the
only one in paratrain that reads them; one small class per scheduler says whether it started this process and
reads it; everything else receives a :class:`ClusterEnvironment`::

    env = ClusterEnvironment.detect()
    if env.launched:                           # False in a process nothing started: rank 0 of 1
        env.scheduler, env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port

torchrun comes first: inside a SLURM allocation (one task per node running torchrun) or a PyTorchJob running
torchrun, its workers keep torchrun's world, without a warning. Where a scheduler's variables and torchrun's
disagree with no torchrun in between (SLURM_NTASKS=4 beside WORLD_SIZE=2), :meth:`ClusterEnvironment.detect`
raises a :class:`~paratrain.errors.ConfigError` naming both, before any process group forms.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

from paratrain.errors import ConfigError
from paratrain.hostlist import expand_hostlist

__all__ = ["SCHEDULERS", "ClusterEnvironment", "Scheduler", "launched_by_torchrun"]

# the variables every torchrun worker has: without all of them, torchrun did not start this process
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORTS = (10_000, 50_000)  # a port derived from SLURM_JOB_ID: the first, plus the job id modulo the second


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process sits in a job, as what started it told it (rank 0 of 1 when nothing did)."""

    launched: bool = False  # a launcher or scheduler started this process as one rank of a job
    rank: int = 0  # among every process of the job
    local_rank: int = 0  # among this machine's processes: the GPU it takes
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0  # this machine's place among the machines (torchrun's GROUP_RANK, SLURM_NODEID)
    master_addr: str | None = None  # where rank 0 hosts the rendezvous
    master_port: int | None = None
    restart_count: int = 0  # how often the launcher restarted this worker's group (0: the first attempt)
    run_id: str | None = None  # the job's id, the same on every machine and across restarts
    agent_store: bool = False  # the workers meet in the launcher's own store (torchrun's default)
    scheduler: str = "none"  # what started this process: torchrun, slurm, kubeflow, openmpi, mpich, none
    read: dict[str, str] = field(default_factory=dict, hash=False)  # the variables read (paratrain env shows them)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
        """This process's place, from the first of :data:`SCHEDULERS` that started it (``environ``: ``os.environ``).

        Raises:
            ConfigError: the variables are there but malformed (not integers, a rank outside the world, a host
                list that does not parse), or a scheduler's contradict torchrun's with no torchrun in between.
        """
        values = os.environ if environ is None else environ
        restarts = values.get("TORCHELASTIC_RESTART_COUNT", "0")
        elastic = {
            "restart_count": int(restarts) if restarts.isdigit() else 0,
            "run_id": values.get("TORCHELASTIC_RUN_ID") or None,
            "agent_store": values.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        }
        scheduler = next((s for s in SCHEDULERS if s.started(values)), None)
        if scheduler is None:
            return cls(**elastic)  # type: ignore[arg-type]
        env = scheduler.read(values)
        if not 0 <= env.rank < env.world_size:
            raise ConfigError(
                f"{scheduler.rank_name}={env.rank} is outside {scheduler.world_name}={env.world_size}; "
                f"the {scheduler.name} variables are broken"
            )
        if not 0 <= env.local_rank < env.local_world_size:
            raise ConfigError(
                f"the local rank {env.local_rank} is outside this machine's {env.local_world_size} processes; "
                f"the {scheduler.name} variables are broken"
            )
        if scheduler.name != "torchrun":
            _agrees_with_torchrun_variables(scheduler, env, values)
        run_id = elastic.pop("run_id") or env.run_id
        return replace(env, run_id=run_id, **elastic)  # type: ignore[arg-type]

    @property
    def init_method(self) -> str:
        """``tcp://MASTER_ADDR:MASTER_PORT``: where the ranks meet when no launcher's store is there to use."""
        host = f"[{self.master_addr}]" if self.master_addr and ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


class Scheduler:
    """What starts a job's processes: whether it started this one, and where that put it."""

    name: ClassVar[str]
    rank_name: ClassVar[str]  # the variable holding the rank (in messages)
    world_name: ClassVar[str]

    def started(self, values: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def read(self, values: Mapping[str, str]) -> ClusterEnvironment:
        raise NotImplementedError

    def _env(self, values: Mapping[str, str], names: tuple[str, ...], **fields: object) -> ClusterEnvironment:
        read = {name: values[name] for name in names if name in values}
        return ClusterEnvironment(launched=True, scheduler=self.name, read=read, **fields)  # type: ignore[arg-type]


class Torchrun(Scheduler):
    """torchrun, ``python -m torch.distributed.run`` and ``paratrain launch``: RANK, LOCAL_RANK, WORLD_SIZE, ..."""

    name, rank_name, world_name = "torchrun", "RANK", "WORLD_SIZE"
    NAMES = (*_TORCHRUN, "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")

    def started(self, values: Mapping[str, str]) -> bool:
        return all(name in values for name in _TORCHRUN)

    def read(self, values: Mapping[str, str]) -> ClusterEnvironment:
        rank, world_size = _int(values, "RANK"), _int(values, "WORLD_SIZE")
        local_world_size = _int(values, "LOCAL_WORLD_SIZE", default=world_size)
        return self._env(
            values,
            self.NAMES,
            rank=rank,
            local_rank=_int(values, "LOCAL_RANK"),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int(values, "GROUP_RANK", default=rank // max(local_world_size, 1)),
            master_addr=values["MASTER_ADDR"],
            master_port=_int(values, "MASTER_PORT"),
        )


class Slurm(Scheduler):
    """A task ``srun`` started (SLURM_STEP_ID is set: a job step, not the batch script itself).

    The rendezvous is MASTER_ADDR, or else the first host of the step's node list; the port MASTER_PORT, or else
    one derived from SLURM_JOB_ID (the same in every task of the job, different between jobs)."""

    name, rank_name, world_name = "slurm", "SLURM_PROCID", "SLURM_NTASKS"
    NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    NAMES = (
        *("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE"),
        *("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", *NODELISTS, "SLURM_JOB_ID", "SLURM_STEP_ID"),
        *("MASTER_ADDR", "MASTER_PORT"),
    )

    def started(self, values: Mapping[str, str]) -> bool:
        task = all(name in values for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        return task and ("SLURM_STEP_ID" in values or "SLURM_STEPID" in values)

    def read(self, values: Mapping[str, str]) -> ClusterEnvironment:
        node = _int(values, "SLURM_NODEID", default=0)
        job = values.get("SLURM_JOB_ID")
        if "MASTER_ADDR" in values:
            addr = values["MASTER_ADDR"]
        else:
            listed = next((name for name in self.NODELISTS if values.get(name)), None)
            if listed is None:
                raise ConfigError(
                    "srun started this process but no node list is set (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
                    "SLURM_NODELIST) to find the rendezvous host in: set MASTER_ADDR to the first node's address"
                )
            addr = expand_hostlist(values[listed], listed)[0]
        if "MASTER_PORT" in values:
            port = _int(values, "MASTER_PORT")
        elif job is not None and job.isdigit():
            port = SLURM_PORTS[0] + int(job) % SLURM_PORTS[1]
        else:
            raise ConfigError(
                f"srun started this process but SLURM_JOB_ID={job!r} gives no port for the rendezvous: set "
                f"MASTER_PORT (the same free port in every task)"
            )
        return self._env(
            values,
            self.NAMES,
            rank=_int(values, "SLURM_PROCID"),
            local_rank=_int(values, "SLURM_LOCALID"),
            world_size=_int(values, "SLURM_NTASKS"),
            local_world_size=_tasks_on_node(values, node),
            node_rank=node,
            master_addr=addr,
            master_port=port,
            run_id=job,
        )


class Kubeflow(Scheduler):
    """A Kubeflow PyTorchJob pod: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, no LOCAL_RANK (one process a pod)."""

    name, rank_name, world_name = "kubeflow", "RANK", "WORLD_SIZE"
    NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "KUBERNETES_SERVICE_HOST")

    def started(self, values: Mapping[str, str]) -> bool:
        pod = "KUBERNETES_SERVICE_HOST" in values  # set in every Kubernetes pod
        return pod and all(n in values for n in self.NAMES) and "LOCAL_RANK" not in values

    def read(self, values: Mapping[str, str]) -> ClusterEnvironment:
        rank = _int(values, "RANK")
        return self._env(
            values,
            self.NAMES,
            rank=rank,
            world_size=_int(values, "WORLD_SIZE"),
            node_rank=rank,
            master_addr=values["MASTER_ADDR"],
            master_port=_int(values, "MASTER_PORT"),
        )


class Mpi(Scheduler):
    """A rank ``mpirun`` started: its rank, size and local rank from OpenMPI's or MPICH's variables; the
    rendezvous from MASTER_ADDR and MASTER_PORT, which mpirun passes on when told (``-x`` or ``-genv``)."""

    name = rank_name = world_name = local_name = local_size_name = ""

    def started(self, values: Mapping[str, str]) -> bool:
        return self.rank_name in values and self.world_name in values

    def read(self, values: Mapping[str, str]) -> ClusterEnvironment:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in values]
        if missing:
            raise ConfigError(
                f"mpirun started this process ({self.rank_name} is set) but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: pass the rendezvous to every rank, e.g. mpirun "
                f"{self.export('MASTER_ADDR', 'host0')} {self.export('MASTER_PORT', '29500')} ..."
            )
        world_size = _int(values, self.world_name)
        local_size = _int(values, self.local_size_name, default=world_size)
        rank = _int(values, self.rank_name)
        names = (self.rank_name, self.world_name, self.local_name, self.local_size_name, "MASTER_ADDR", "MASTER_PORT")
        return self._env(
            values,
            names,
            rank=rank,
            local_rank=_int(values, self.local_name, default=rank % max(local_size, 1)),
            world_size=world_size,
            local_world_size=local_size,
            node_rank=rank // max(local_size, 1),
            master_addr=values["MASTER_ADDR"],
            master_port=_int(values, "MASTER_PORT"),
        )

    def export(self, name: str, value: str) -> str:
        return f"-x {name}={value}"


class OpenMpi(Mpi):
    name, rank_name, world_name = "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    local_name, local_size_name = "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"


class Mpich(Mpi):
    """MPICH's and Intel MPI's Hydra launcher (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS)."""

    name, rank_name, world_name = "mpich", "PMI_RANK", "PMI_SIZE"
    local_name, local_size_name = "MPI_LOCALRANKID", "MPI_LOCALNRANKS"

    def export(self, name: str, value: str) -> str:
        return f"-genv {name} {value}"


# in this order: torchrun's world wins wherever it runs; OpenMPI's ranks inside a SLURM allocation carry the
# allocation's SLURM_* variables too (of the daemon mpirun started there); srun --mpi=pmi2 sets PMI_RANK as well
SCHEDULERS: tuple[Scheduler, ...] = (Torchrun(), OpenMpi(), Slurm(), Kubeflow(), Mpich())


def _agrees_with_torchrun_variables(scheduler: Scheduler, env: ClusterEnvironment, values: Mapping[str, str]) -> None:
    """torchrun's variables left over beside a scheduler's (an ``export WORLD_SIZE=2`` in a batch script) must say
    what the scheduler says: no launcher sits between them to make them true."""
    for name, found, theirs in (
        ("WORLD_SIZE", env.world_size, scheduler.world_name),
        ("RANK", env.rank, scheduler.rank_name),
        ("LOCAL_RANK", env.local_rank, None),
    ):
        if name in values and theirs != name and values[name].strip() != str(found):
            said = f"{theirs}={values[theirs]}" if theirs else f"the local rank {found}"
            raise ConfigError(
                f"{scheduler.name} started this process with {said} but {name}={values[name]}, and no launcher "
                f"(torchrun) runs between them to make that true: unset {name}, or start the job with as many "
                f"tasks as you meant ({scheduler.world_name}) or through torchrun"
            )


def _tasks_on_node(values: Mapping[str, str], node: int) -> int:
    """SLURM's tasks on node ``node``: SLURM_NTASKS_PER_NODE, or the compressed count list ``2(x3),1``."""
    per_node = values.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        return int(per_node)
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if values.get(n)), None)
    if name is None:
        return _int(values, "SLURM_NTASKS")
    counts: list[int] = []
    for item in values[name].split(","):
        count, _, times = item.strip().partition("(x")
        if not count.isdigit() or (times and not times.rstrip(")").isdigit()):
            raise ConfigError(f"{name}={values[name]!r} does not parse as SLURM's task counts such as '2(x3),1'")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    if node >= len(counts):
        raise ConfigError(f"SLURM_NODEID={node} but {name}={values[name]!r} counts {len(counts)} node(s)")
    return counts[node]


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker process started by a launcher or scheduler (one rank of a job)."""
    return ClusterEnvironment.detect(environ).launched


def _int(values: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = values.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={text!r} is not an integer; the launcher's variables are broken") from None
