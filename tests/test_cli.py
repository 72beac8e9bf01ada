"""The command line, run as users run it: a real subprocess through the installed entry points."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess

import pytest

from conftest import run_main
from processes import CLI_TIMEOUT_S, cli_command, start_cli
from processes import run_cli as _run


@pytest.mark.processes
def test_env_reports_versions_and_backends():
    result = _run("env")
    assert result.returncode == 0, result.stderr
    for field in ("paratrain", "python", "torch", "gpus", "distributed", "gloo"):
        assert field in result.stdout
    report = json.loads(_run("env", "--json").stdout)
    assert report["backends"]["gloo"] is True
    assert isinstance(report["accelerators"], list)


@pytest.mark.processes
def test_env_says_which_scheduler_started_the_process_and_what_it_read():
    srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "77", "SLURM_NODELIST": "n[01-02]"}  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    result = subprocess.run(cli_command("env"), env={**clean, **srun}, capture_output=True, text=True, timeout=60)
    assert "started by     slurm: rank 1 of 2, local rank 1 of 2, node 0, rendezvous n01:10077" in result.stdout
    assert "  SLURM_NODELIST=n[01-02]" in result.stdout
    found = subprocess.run(cli_command("env", "--json"), env={**clean, **srun, "WORLD_SIZE": "4"},
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    scheduler = json.loads(found.stdout)["scheduler"]
    assert found.returncode == 0 and scheduler["name"] == "error"  # a bug report still comes out
    assert "SLURM_NTASKS=2 but WORLD_SIZE=4" in scheduler["error"]


@pytest.mark.processes
def test_demo_prints_the_seed_lines_for_three_cpu_replicas():
    result = _run("demo", "--devices", "cpu,cpu,cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    inside = [line for line in lines if "In Model" in line]
    assert inside.count("\tIn Model: input size torch.Size([10, 5]) output size torch.Size([10, 2])") == 9
    assert lines.count("Outside: input size torch.Size([30, 5]) output_size torch.Size([30, 2])") == 3
    assert "Batch 1: 30 samples split as [10, 10, 10] over cpu, cpu, cpu" in lines
    # the last batch of 100 is 10 samples: [4, 3, 3]
    assert "Batch 4: 10 samples split as [4, 3, 3] over cpu, cpu, cpu" in lines
    assert "Outside: input size torch.Size([10, 5]) output_size torch.Size([10, 2])" in lines


@pytest.mark.processes
def test_demo_defaults_to_two_cpu_replicas_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("default devices are the GPUs here")
    result = _run("demo", "--data-size", "30")
    assert result.returncode == 0, result.stderr
    assert "\tIn Model: input size torch.Size([15, 5]) output size torch.Size([15, 2])" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--devices", "banana"], "is not a device"),
        (["demo", "--devices", "cpu,,cpu"], "empty entry"),
        (["demo", "--batch-size", "0"], "--batch-size must be at least 1; found 0"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_without_traceback(capsys, args, message):
    code, _, err = run_main(capsys, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


# --- help and wording -----------------------------------------------------------------------------------------------


def test_launch_help_wraps_its_description_and_keeps_its_examples(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_main(capsys, "launch", "--help")
    assert code == 0
    description = out.split("\n\n")[1]  # after the usage block
    assert description.startswith("Start SCRIPT") and all(len(line) <= 80 for line in description.splitlines())
    assert "\n  paratrain launch --nproc-per-node 4 train.py --epochs 3\n" in out  # an example line, kept whole


def test_demo_help_gives_every_option_its_help_and_default(capsys):
    code, out, _ = run_main(capsys, "demo", "--help")
    assert code == 0
    for flag, default in (("--devices", "auto"), ("--batch-size", "30"), ("--data-size", "100"), ("--seed", "0")):
        entry = " ".join(out.split(flag, 2)[2].split("--")[0].split())  # the text after the option's name
        assert f"(default {default})" in entry, entry


def test_a_script_option_before_the_script_says_where_script_options_go(capsys):
    code, _, err = run_main(capsys, "launch", "--epochs", "1", "train.py")
    assert code == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --epochs; options for the script go after it" in err


@pytest.mark.parametrize("args", [["--timeout", "5"], ["--strategy", "dp", "--devices", "cpu,cpu", "--timeout", "5"]])
def test_timeout_for_a_run_in_one_process_is_refused(capsys, args):
    code, out, err = run_main(capsys, "train", *args)
    assert code == 2 and "Epoch" not in out
    assert "--timeout is for strategy 'ddp'" in err and "which runs in this one process" in err


@pytest.mark.parametrize(
    "args, flags",
    [
        (["--find-unused-parameters"], "--find-unused-parameters is"),
        (["--strategy", "dp", "--devices", "cpu,cpu", "--static-graph", "--bucket-cap-mb", "5"], "--static-graph, "),
    ],
)
def test_ddp_options_for_a_run_in_one_process_are_refused(capsys, args, flags):
    code, out, err = run_main(capsys, "train", *args)
    assert code == 2 and "Epoch" not in out
    assert flags in err and "for strategies ddp, zero1 and zero2" in err and "add --strategy ddp" in err


def test_a_ddp_option_the_strategy_refuses_is_refused_before_any_rank_starts(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('strategy = "zero3"\nbucket-cap-mb = 8\nnproc-per-node = 2\n')  # a settings file picks it up
    code, out, err = run_main(capsys, "train", "--config", str(config), "--devices", "cpu")
    assert code == 2 and "Epoch" not in out and "rank" not in out
    assert "--bucket-cap-mb is not supported under strategy zero3: zero3 reduces gradients unit by unit" in err
    assert "drop --bucket-cap-mb, or use --strategy ddp, zero1 or zero2" in err


def test_a_bucket_size_flag_says_what_it_takes(capsys):
    code, _, err = run_main(capsys, "train", "--bucket-cap-mb", "0")
    assert code == 2 and "--bucket-cap-mb" in err and "positive" in err


def test_dp_on_one_device_says_it_runs_one_replica_and_counts_are_singular(capsys):
    code, out, err = run_main(capsys, "train", "--strategy", "dp", "--epochs", "1", "--max-steps", "1")
    assert code == 0, err
    assert "note: --strategy dp on one device (cpu) runs a single replica" in err and "--devices cpu,cpu" in err
    assert ", 1 epoch\n" in out and "1 epochs" not in out


# --- pipes ----------------------------------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize(
    "args, lines",
    # the demo on 100000 samples writes 1.2 MB, far more than a pipe holds, so it is still writing when the reader
    # goes (its default 100 samples are 1.4 KB, which a busy machine let it write whole and exit 0 before the close)
    [
        (["train", "--epochs", "3", "--log-every", "1"], 2),
        (["demo", "--devices", "cpu,cpu,cpu", "--data-size", "100000"], 3),
    ],
)
def test_a_closed_pipe_ends_the_command_quietly(args, lines):
    """`paratrain train | head -2`: the reader goes away; the command ends as a Unix tool does, no traceback."""
    proc = start_cli(*args)
    assert proc.stdout is not None and proc.stderr is not None
    for _ in range(lines):
        assert proc.stdout.readline()
    proc.stdout.close()  # head exits
    err = proc.stderr.read()
    assert proc.wait(timeout=CLI_TIMEOUT_S) == 141, err  # 128 + SIGPIPE, as a shell shows for `yes | head`
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("merged", [False, True], ids=["| head", "2>&1 | head"])
def test_a_closed_pipe_ends_a_ddp_run_quietly_as_one_process(merged, tmp_path):
    """`paratrain train --strategy ddp ... | head -3`: rank 0's reader goes away; the job ends as one process
    would, with 141 and no line per rank (nor, with 2>&1, an exit code from failing to write those lines)."""
    read, write = os.pipe()
    fcntl.fcntl(read, fcntl.F_SETPIPE_SZ, 4096)  # smaller than the run's lines: rank 0 writes after the close
    args = ("--strategy", "ddp", "--nproc-per-node", "2", "--model", "mlp", "--width", "16", "--depth", "1")
    args += ("--epochs", "1", "--batch-size", "16", "--log-every", "1", "--no-tensorboard", "--no-plot")
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    proc = subprocess.Popen(cli_command("train", *args), stdout=write, stderr=stderr, cwd=tmp_path)
    os.close(write)
    with os.fdopen(read, "rb") as head:
        lines = [head.readline() for _ in range(3)]
    assert lines[0].startswith(b"Training mlp") and lines[2].startswith(b"Epoch 0, Step 1,"), lines
    err = proc.communicate(timeout=CLI_TIMEOUT_S)[1]
    assert proc.returncode == 141, err
    if not merged:
        assert b"rank 0" not in err and b"rank 1" not in err and b"Traceback" not in err, err


@pytest.mark.processes
@pytest.mark.slow
def test_metrics_to_dev_stdout_go_through_a_pipe_as_json():
    result = _run("train", "--epochs", "1", "--max-steps", "2", "--metrics-out", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)  # stdout holds the JSON alone: the run's lines went to stderr
    assert metrics["steps"] == 2 and "Stopped at epoch 0, batch 2" in result.stderr
