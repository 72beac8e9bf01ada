"""--log-with mlflow / wandb: the runs read back through MLflow's own client and from W&B's offline run files."""

from __future__ import annotations

import sys

import pytest

from conftest import run_main

TINY = ("--epochs", "1", "--max-steps", "5", "--batch-size", "32", "--log-every", "2", "--quiet", "--lr", "0.05")
FILES = ("--no-plot", "--no-tensorboard")


@pytest.mark.processes  # importing MLflow runs `uname -p` (through platform.processor)
def test_mlflow_gets_the_config_as_parameters_and_the_logged_series(capsys, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="--log-with mlflow needs paratrain[mlflow] (pip install mlflow-skinny)")
    from mlflow import MlflowClient

    from paratrain.training.trackers import mlflow_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # MLflow would report its use otherwise
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's own switch for its file store
    logs = tmp_path / "logs"
    code, _, err = run_main(capsys, "train", *TINY, *FILES, "--log-dir", str(logs), "--log-with", "mlflow")
    assert code == 0, err
    client = MlflowClient(tracking_uri=mlflow_store(logs))
    experiment = client.get_experiment_by_name("paratrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["lr"] == "0.05" and run.data.params["batch_size"] == "32"
    assert run.data.params["log_with"] == "['mlflow']" and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [0, 2, 4]
    assert {"train/grad_norm", "train/samples_per_s", "train/flops_per_s", "memory/rss_mib"} <= set(run.data.metrics)


@pytest.mark.processes  # importing MLflow runs `uname -p` (through platform.processor)
def test_mlflow_without_a_store_it_may_use_is_a_usage_error(capsys, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="--log-with mlflow needs paratrain[mlflow] (pip install mlflow-skinny)")
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow package is installed here: it logs to a SQLite database in --log-dir")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    code, out, err = run_main(capsys, "train", *TINY, *FILES, "--log-dir", str(tmp_path), "--log-with", "mlflow")
    if code == 0:
        pytest.skip("this MLflow still allows its file store without MLFLOW_ALLOW_FILE_STORE")
    assert code == 2 and "--log-with mlflow needs a tracking store" in err and "MLFLOW_ALLOW_FILE_STORE=true" in err
    assert "Training" not in out


@pytest.mark.processes  # W&B runs its core as a helper process, even offline
def test_wandb_offline_files_hold_the_config_and_the_logged_series(capsys, tmp_path):
    pytest.importorskip("wandb", reason="--log-with wandb needs paratrain[wandb] (pip install wandb)")
    from wandb_files import history_and_config

    logs = tmp_path / "logs"
    code, out, err = run_main(capsys, "train", *TINY, *FILES, "--log-dir", str(logs), "--log-with", "wandb")
    assert code == 0, err
    assert "wandb:" not in out + err  # W&B's banner and console capture are off: the job's lines are its own
    (run_dir,) = (logs / "wandb").glob("offline-run-*")
    rows, config = history_and_config(run_dir)
    assert config.get("lr") == 0.05 and config.get("batch_size") == 32, (sorted(config), len(rows))
    steps = [row["_step"] for row in rows if "train/loss" in row]
    assert steps == [0, 2, 4]
    assert all(
        {"train/grad_norm", "train/lr", "train/samples_per_s"} <= row.keys() for row in rows if "train/loss" in row
    )


@pytest.mark.parametrize(("tracker", "package"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_missing_extra_is_a_usage_error_naming_the_package(capsys, tmp_path, monkeypatch, tracker, package):
    monkeypatch.setitem(sys.modules, package, None)  # how Python marks a module as not importable
    metrics = tmp_path / "m.json"
    code, out, err = run_main(
        capsys, "train", *TINY, "--log-dir", str(tmp_path), "--log-with", tracker, "--metrics-out", str(metrics)
    )
    assert code == 2
    assert f"--log-with {tracker} needs the {package} package" in err and f"paratrain[{tracker}]" in err
    assert not metrics.exists() and "Training" not in out


def test_log_with_needs_a_log_dir_and_a_known_tracker(capsys):
    code, _, err = run_main(capsys, "train", *TINY, "--log-with", "mlflow")
    assert code == 2 and "add --log-dir DIR" in err
    code, _, err = run_main(capsys, "train", *TINY, "--log-dir", "x", "--log-with", "neptune")
    assert code == 2 and "--log-with must be some of: csv, tensorboard, mlflow, wandb; found ['neptune']" in err
