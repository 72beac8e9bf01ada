"""``--log-with``: experiment trackers beside ``--log-dir``'s own files, written by rank 0 only.

    check_trackers(["mlflow"])                       # ConfigError naming the package when it is not installed
    trackers = open_trackers(["mlflow", "wandb"], "runs/a", config=config.to_dict(), name="runs/a")
    for tracker in trackers:
        tracker.scalars({"train/loss": 0.41}, step=100)
        tracker.close()

Every tracker takes the run's settings as its parameters (one per setting, under its field name) and the same
series ``metrics.csv`` holds, under the same names and optimizer steps:

* ``mlflow`` (``pip install 'paratrain[mlflow]'``): one MLflow run per invocation in the experiment
  ``paratrain``, in the tracking store ``MLFLOW_TRACKING_URI`` names (MLflow's own variable), else a SQLite
  database ``DIR/mlflow.db`` (with the full mlflow package), else a file store in ``DIR/mlruns`` (MLflow 3
  wants ``MLFLOW_ALLOW_FILE_STORE=true`` for it: without any of them ``--log-with mlflow`` is a usage error
  saying so). Written through ``MlflowClient``,
  so nothing of MLflow's process-wide "active run" is touched.
* ``wandb`` (``pip install 'paratrain[wandb]'``): a Weights & Biases run in offline mode, in ``DIR/wandb``
  (``wandb sync DIR/wandb/offline-run-*`` uploads it later). Offline always: a run never needs a network or an
  account; W&B itself starts a helper process for it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from paratrain.errors import ConfigError
from paratrain.training.logs import install_hint

__all__ = [
    "LOG_DIR_OUTPUTS",
    "LOG_WITH",
    "TRACKERS",
    "ExperimentTracker",
    "check_trackers",
    "mlflow_store",
    "open_trackers",
]

TRACKERS = ("mlflow", "wandb")
# what --log-dir writes itself, named as Accelerate's log_with names them: accepted by --log-with as those files
LOG_DIR_OUTPUTS = ("csv", "tensorboard")
LOG_WITH = (*LOG_DIR_OUTPUTS, *TRACKERS)  # every name --log-with takes
_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # what each imports (the mlflow extra installs mlflow-skinny)


class ExperimentTracker(Protocol):
    """What the training job writes to a tracker: scalars at optimizer steps, then close."""

    def scalars(self, values: Mapping[str, float], *, step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Sequence[str]) -> None:
    """Raise ConfigError for a tracker whose package is not installed (cheap: nothing is imported)."""
    for name in names:
        if name not in _PACKAGES:
            raise ConfigError(f"unknown tracker {name!r} for --log-with; choose from: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ConfigError(
                f"--log-with {name} needs the {_PACKAGES[name]} package, not importable here: {install_hint(name)}, "
                f"or leave {name} out of --log-with"
            )
        if name == "mlflow" and mlflow_store("DIR") is None:
            raise ConfigError(
                "--log-with mlflow needs a tracking store: this MLflow refuses its file store unless "
                "MLFLOW_ALLOW_FILE_STORE=true, and a local database (sqlite) needs the full mlflow package. Set "
                "MLFLOW_TRACKING_URI (a tracking server), install mlflow for a database in --log-dir, or set "
                "MLFLOW_ALLOW_FILE_STORE=true for a file store in --log-dir/mlruns"
            )


def mlflow_store(directory: str | Path) -> str | None:
    """The MLflow tracking URI a run logs to: ``MLFLOW_TRACKING_URI``, else a SQLite database in ``directory`` when
    SQLAlchemy is installed (the full mlflow package), else a file store in ``directory/mlruns`` where this MLflow
    allows one; None when none of them can be used."""
    given = os.environ.get("MLFLOW_TRACKING_URI")
    if given:
        return given
    folder = Path(directory).resolve()
    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{folder / 'mlflow.db'}"
    from mlflow import environment_variables

    allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if allow is None or allow.get():  # an MLflow from before the file store's maintenance mode, or allowed
        return (folder / "mlruns").as_uri()
    return None


def open_trackers(
    names: Sequence[str], directory: str | Path, *, config: Mapping[str, Any], name: str
) -> list[ExperimentTracker]:
    """Start one run in each tracker ``names`` lists, with ``config`` as its parameters (main process only)."""
    opened: list[ExperimentTracker] = []
    for tracker in dict.fromkeys(names):
        if tracker == "mlflow":
            opened.append(MlflowTracker(Path(directory), config, name))
        elif tracker == "wandb":
            opened.append(WandbTracker(Path(directory), config, name))
        else:
            check_trackers([tracker])
    return opened


class MlflowTracker:
    """One MLflow run, written through an ``MlflowClient`` (see the module docstring)."""

    def __init__(self, directory: Path, config: Mapping[str, Any], name: str) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.tracking_uri = mlflow_store(directory)
        if self.tracking_uri is None:
            check_trackers(["mlflow"])  # raises, saying what to do
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name("paratrain")
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment("paratrain")
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(key, _param(value)) for key, value in config.items()]
        self._client.log_batch(self.run_id, params=params)

    def scalars(self, values: Mapping[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class WandbTracker:
    """One W&B run in offline mode, in ``DIR/wandb``."""

    def __init__(self, directory: Path, config: Mapping[str, Any], name: str) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project="paratrain",
            name=name,
            dir=str(directory),
            mode="offline",
            config=dict(config),
            reinit="create_new",  # a run of its own, never a process-wide one another tracker started
            # the job's own lines stay the job's: no capture of stdout, no banner, no system metrics sampling
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True),
        )

    def scalars(self, values: Mapping[str, float], *, step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def _param(value: Any) -> str:
    return "None" if value is None else str(list(value) if isinstance(value, tuple) else value)
