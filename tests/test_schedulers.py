"""A job started by a cluster's scheduler, with exactly the variables it sets and no launcher: srun's tasks, a
Kubeflow PyTorchJob's pods and mpirun's ranks (OpenMPI's and MPICH's) train, through paratrain.Parallel, the
weights torchrun's job of the same size trains; and the docs' sbatch script and PyTorchJob manifest parse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from processes import free_port

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).parent / "scripts" / "scheduler_job.py"
WORLD = 2
# what a launcher or scheduler may have left in this process's own environment: none of it reaches the ranks
_FOREIGN = re.compile(r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|"
                      r"TORCHELASTIC_.*|SLURM_.*|OMPI_.*|PMI_.*|MPI_LOCAL.*|KUBERNETES_.*)")  # fmt: skip


def _clean() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _FOREIGN.fullmatch(k)}


def _srun(rank: int, port: int) -> dict[str, str]:
    """srun --nodes 1 --ntasks 2 on this host: the job id chosen so that the port it gives is free here."""
    return {
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": str(WORLD),
        "SLURM_NTASKS_PER_NODE": str(WORLD), "SLURM_TASKS_PER_NODE": str(WORLD), "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": str(port - 10_000), "SLURM_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "train",
    }  # fmt: skip


def _pod(rank: int, port: int) -> dict[str, str]:
    """A PyTorchJob's Master (rank 0) and Worker pods, as the training operator sets them."""
    return {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "RANK": str(rank),
            "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}  # fmt: skip


def _openmpi(rank: int, port: int) -> dict[str, str]:
    """mpirun -np 2 -x MASTER_ADDR=localhost -x MASTER_PORT=PORT python scheduler_job.py"""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(WORLD),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(WORLD),
            "OMPI_COMM_WORLD_NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}  # fmt: skip


def _mpich(rank: int, port: int) -> dict[str, str]:
    """mpiexec -n 2 -genv MASTER_ADDR localhost -genv MASTER_PORT PORT python scheduler_job.py (Hydra)"""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(WORLD), "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": str(WORLD), "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}  # fmt: skip


SCHEDULERS = {"slurm": _srun, "kubeflow": _pod, "openmpi": _openmpi, "mpich": _mpich}


def _start(variables: dict[str, str], out: Path, command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*command, str(out)], env={**_clean(), **variables}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def _finish(procs: list[subprocess.Popen[str]], out: Path) -> dict:
    outputs = []
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        outputs.append(output)
        assert proc.returncode == 0, "\n".join(outputs)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every scheduler's job and torchrun's, all at once (starting the processes is the slow part)."""
    tmp = tmp_path_factory.mktemp("schedulers")
    running = {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                "--master-port", str(free_port()), str(JOB)]  # fmt: skip
    running["torchrun"] = [_start({}, tmp / "torchrun.json", torchrun)]
    for name, variables in SCHEDULERS.items():
        port = free_port()
        while name == "slurm" and not 10_000 <= port < 60_000:  # srun's port comes from the job id
            port = free_port()
        running[name] = [_start(variables(rank, port), tmp / f"{name}.json", [sys.executable, str(JOB)])
                         for rank in range(WORLD)]  # fmt: skip
    return {name: _finish(procs, tmp / f"{name}.json") for name, procs in running.items()}


@pytest.mark.processes
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_schedulers_ranks_train_torchruns_model_without_a_launcher(jobs, scheduler):
    found, reference = jobs[scheduler], jobs["torchrun"]
    pods = scheduler == "kubeflow"  # a process per pod: local rank 0, a node each
    expected = [[scheduler, r, 0 if pods else r, WORLD, r if pods else 0] for r in range(WORLD)]
    assert found["places"] == expected
    assert reference["places"][0][0] == "torchrun"
    assert found["weights"] == reference["weights"]


@pytest.mark.processes
@pytest.mark.slow
def test_paratrain_train_runs_under_srun_as_it_runs_under_torchrun(tmp_path):
    """`srun paratrain train ...`: each task is a rank; the model is the one `paratrain train --nproc-per-node 2`
    trains."""
    import torch

    from paratrain.checkpoint.file import latest_checkpoint, load_checkpoint

    common = ["-m", "paratrain", "train", "--quiet", "--epochs", "1", "--max-steps", "20", "--strategy", "ddp",
              "--devices", "cpu"]  # fmt: skip
    one_thread = {**_clean(), "OMP_NUM_THREADS": "1"}  # thread counts change float summation order
    port = free_port()
    while not 10_000 <= port < 60_000:
        port = free_port()
    tasks = [
        subprocess.Popen([sys.executable, *common, "--checkpoint-dir", str(tmp_path / "srun"),
                          "--metrics-out", str(tmp_path / "srun.json")],
                         env={**one_thread, **_srun(rank, port)}, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
        for rank in range(WORLD)
    ]  # fmt: skip
    torchrun = subprocess.run(
        [sys.executable, *common, "--nproc-per-node", str(WORLD), "--checkpoint-dir", str(tmp_path / "torchrun")],
        env=one_thread, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    outputs = [task.communicate(timeout=400)[0] for task in tasks]
    assert all(task.returncode == 0 for task in tasks), outputs
    assert torchrun.returncode == 0, torchrun.stderr
    metrics = json.loads((tmp_path / "srun.json").read_text())
    assert metrics["world_size"] == WORLD and metrics["strategy"] == "ddp"
    ours, theirs = (load_checkpoint(latest_checkpoint(tmp_path / d))["model"] for d in ("srun", "torchrun"))
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.processes
def test_a_contradiction_ends_paratrain_train_with_exit_2_and_one_line_naming_both_values(tmp_path):
    variables = {**_srun(1, 14_242), "WORLD_SIZE": "4"}  # an `export WORLD_SIZE=4` left in the batch script
    done = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
        env={**_clean(), **variables}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "paratrain train: error: slurm started this process with SLURM_NTASKS=2 but WORLD_SIZE=4, and no launcher "
        "(torchrun) runs between them to make that true: unset WORLD_SIZE, or start the job with as many tasks as "
        "you meant (SLURM_NTASKS) or through torchrun"
    ]
    assert not (tmp_path / "ckpt").exists()  # before any work started
