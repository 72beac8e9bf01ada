"""What started this process (torchrun, srun, a PyTorchJob pod, mpirun) is read in one module, into one frozen
object; SLURM's compressed host lists expand; contradictions are one ConfigError naming both values."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import paratrain
from paratrain.environment import ClusterEnvironment, launched_by_torchrun
from paratrain.errors import ConfigError
from paratrain.hostlist import expand_hostlist

PACKAGE = Path(paratrain.__file__).parent
VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_NODELIST",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "KUBERNETES_SERVICE_HOST",
)  # fmt: skip
LAUNCHED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def test_a_launched_worker_sees_where_it_sits():
    env = ClusterEnvironment.detect({**LAUNCHED, "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job"})
    assert dataclasses.replace(env, read={}) == ClusterEnvironment(
        launched=True, rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
        master_addr="10.0.0.1", master_port=29500, restart_count=2, run_id="job", agent_store=False,
        scheduler="torchrun",
    )  # fmt: skip
    assert env.read["RANK"] == "3" and env.read["MASTER_ADDR"] == "10.0.0.1"
    assert launched_by_torchrun(LAUNCHED) and not launched_by_torchrun({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0  # type: ignore[misc]


def test_without_a_launcher_it_is_rank_0_of_1_and_keeps_the_elastic_ids():
    env = ClusterEnvironment.detect({"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not env.launched and (env.rank, env.world_size) == (0, 1)
    assert env.run_id == "job-1" and env.restart_count == 1


@pytest.mark.parametrize(
    "override, message", [({"RANK": "x"}, "RANK='x' is not an integer"), ({"RANK": "4"}, "outside WORLD_SIZE=4")]
)
def test_broken_variables_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        ClusterEnvironment.detect({**LAUNCHED, **override})


def test_the_variables_are_read_in_one_module_only():
    """No other module of paratrain names torchrun's variables: they all receive the environment object."""
    names = re.compile(r"[\"'](" + "|".join(VARIABLES) + r")[\"']")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "environment.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if names.search(line)
    ]
    assert found == [], found
    assert len(names.findall((PACKAGE / "environment.py").read_text())) >= len(VARIABLES)  # the test can see reads


# -- the schedulers: exactly the variables each sets ----------------------------------------------------------------

# srun --nodes 2 --ntasks-per-node 2: task 3 (the second on node 1), the allocation's node list compressed
SRUN = {
    "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0", "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
}  # fmt: skip
POD = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
       "KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "0"}  # fmt: skip
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}  # fmt: skip
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
         "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}  # fmt: skip


def _place(env: ClusterEnvironment) -> tuple:
    return (env.scheduler, env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank,
            env.master_addr, env.master_port)  # fmt: skip


@pytest.mark.parametrize(
    "variables, place",
    [
        (SRUN, ("slurm", 3, 1, 4, 2, 1, "gpu07", 10_000 + 4242)),
        ({**SRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}, ("slurm", 3, 1, 4, 2, 1, "10.1.1.1", 29400)),
        ({k: v for k, v in SRUN.items() if k != "SLURM_NTASKS_PER_NODE"}, ("slurm", 3, 1, 4, 2, 1, "gpu07", 14242)),
        (POD, ("kubeflow", 2, 0, 3, 1, 2, "job-master-0", 23456)),
        (OPENMPI, ("openmpi", 5, 1, 8, 4, 1, "node0", 29500)),
        (MPICH, ("mpich", 2, 0, 4, 2, 1, "node0", 29500)),
    ],
    ids=["srun", "srun-master-set", "srun-task-counts", "pytorchjob", "openmpi", "mpich"],
)
def test_each_scheduler_is_read_from_the_variables_it_sets(variables, place):
    env = ClusterEnvironment.detect(variables)
    assert env.launched and _place(env) == place
    assert env.read and all(variables[name] == value for name, value in env.read.items())
    assert env.init_method == f"tcp://{place[6]}:{place[7]}"


def test_a_slurm_job_id_gives_the_job_one_port_in_a_range():
    ports = {ClusterEnvironment.detect({**SRUN, "SLURM_JOB_ID": str(job)}).master_port for job in range(0, 10**6, 997)}
    assert min(ports) >= 10_000 and max(ports) < 60_000 and len(ports) > 900


def test_torchrun_inside_an_allocation_keeps_torchruns_world():
    """One task per node running torchrun: its workers carry the allocation's SLURM variables too."""
    inside = {**SRUN, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", **LAUNCHED}
    assert _place(ClusterEnvironment.detect(inside)) == ("torchrun", 3, 1, 4, 2, 1, "10.0.0.1", 29500)
    assert _place(ClusterEnvironment.detect({**POD, **LAUNCHED}))[0] == "torchrun"  # a PyTorchJob running torchrun


def test_the_batch_script_itself_is_no_task_of_a_step():
    """sbatch runs the script once, on the first node, with the allocation's variables but no step: not a rank."""
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert not ClusterEnvironment.detect({**batch, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).launched


def test_openmpi_ranks_inside_a_slurm_allocation_are_mpis():
    assert ClusterEnvironment.detect({**SRUN, **OPENMPI}).scheduler == "openmpi"


@pytest.mark.parametrize(
    "variables, message",
    [
        ({**SRUN, "WORLD_SIZE": "2"}, "slurm started this process with SLURM_NTASKS=4 but WORLD_SIZE=2, and no"),
        ({**SRUN, "RANK": "0"}, "SLURM_PROCID=3 but RANK=0"),
        ({**SRUN, "LOCAL_RANK": "0"}, "the local rank 1 but LOCAL_RANK=0"),
        ({**OPENMPI, "WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=8 but WORLD_SIZE=4"),
        ({**SRUN, "SLURM_STEP_NODELIST": "gpu[07-08"}, r"SLURM_STEP_NODELIST='gpu\[07-08' does not parse"),
        ({**SRUN, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside SLURM_NTASKS=4"),
        ({**SRUN, "SLURM_LOCALID": "2"}, "the local rank 2 is outside this machine's 2 processes"),
        ({**SRUN, "SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x' gives no port"),
        ({k: v for k, v in OPENMPI.items() if k != "MASTER_PORT"}, "MASTER_PORT is not: .* -x MASTER_PORT=29500"),
        ({k: v for k, v in MPICH.items() if not k.startswith("MASTER")}, "-genv MASTER_ADDR host0"),
    ],
    ids=["ntasks-world", "rank", "local-rank", "mpi-world", "nodelist", "procid", "localid", "job-id", "ompi-port",
         "mpich-rendezvous"],
)  # fmt: skip
def test_contradictions_and_broken_variables_are_one_error_naming_both(variables, message):
    with pytest.raises(ConfigError, match=message) as raised:
        ClusterEnvironment.detect(variables)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu-[3]-ib", ["gpu-3-ib"]),
        ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_slurm_host_lists_expand(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist, why",
    [("", "empty"), ("n[1-", "never closes"), ("n1]", "never opened"), ("n[[1]]", "inside another"),
     ("n[a-b]", "neither a number"), ("n[5-2]", "backwards"), ("a,,b", "empty host")],
)  # fmt: skip
def test_a_host_list_that_does_not_parse_says_why(hostlist, why):
    with pytest.raises(ConfigError, match=why):
        expand_hostlist(hostlist)
