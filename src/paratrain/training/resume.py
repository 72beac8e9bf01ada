"""Where a run starts: from scratch, from a checkpoint of the same run, or not at all because it is complete.

    start = plan_start(config, Path("runs/a"), continuing=False)   # ConfigError before any work starts
    if start.complete:
        print(start.complete_message())                            # nothing to train; exit 0

A checkpoint directory belongs to one run. A new run (no ``--resume``) is refused a directory that holds another
run's checkpoints, since its own would replace and prune them; ``--resume`` continues the latest one there only
when the settings that define the run (:data:`IDENTITY`) are the checkpoint's, and names every one that differs
otherwise; a run whose checkpoint is already at ``--epochs`` is complete. A worker restarted by the launcher
(``continuing``) takes the latest checkpoint of its own directory, whatever it was asked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paratrain.checkpoint.file import latest_checkpoint, list_checkpoints
from paratrain.checkpoint.sharded import is_sharded_checkpoint, read_plain
from paratrain.errors import CheckpointError, ConfigError
from paratrain.settings import flag_of
from paratrain.training.config import RESUME_MODES, TrainConfig

__all__ = ["IDENTITY", "SavedRun", "Start", "differences", "identity", "plan_start", "read_saved_run"]

# the settings that define a run: a checkpoint continues only a run with the same ones
IDENTITY = (
    "model",
    "dataset",
    "batch_size",
    "seed",
    "width",
    "depth",
    "optimizer",
    "lr_schedule",
    "warmup_steps",
    "precision",
)
# what checkpoints that do not record a setting ran with
_IDENTITY_DEFAULTS = {"optimizer": "sgd", "lr_schedule": "constant", "precision": "32", "warmup_steps": 0}


def identity(config: TrainConfig) -> dict[str, Any]:
    """The settings of ``config`` that define its run (``epochs`` too: a cosine schedule depends on it)."""
    values = {**asdict(config), "dataset": config.dataset_name}
    return {key: values[key] for key in (*IDENTITY, "epochs")}


def differences(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """Each setting of ``config`` that cannot continue the run ``saved`` (a checkpoint's identity) recorded, as
    ``--flag: checkpoint X, this run Y``; empty when the run can continue."""
    saved = {**_IDENTITY_DEFAULTS, **saved}
    wanted = identity(config)
    keys = list(IDENTITY)
    if config.lr_schedule == "cosine" and "epochs" in saved:  # the cosine decays to 0 at the last epoch's end
        keys.append("epochs")
    return [
        f"{flag_of(key)}: checkpoint {saved.get(key)!r}, this run {wanted[key]!r}"
        for key in keys
        if saved.get(key) != wanted[key]
    ]


@dataclass(frozen=True)
class SavedRun:
    """What a run's checkpoint says about that run: where it is, what it was asked for, how its epochs went."""

    path: Path
    epoch: int  # the next epoch to train
    batch: int  # the next batch of that epoch
    global_step: int
    identity: dict[str, Any]
    epochs: int | None  # the --epochs it was asked for (None: not recorded)
    metrics_out: str | None = None
    epoch_losses: list[float] = field(default_factory=list)
    epoch_test_accuracy: list[float] = field(default_factory=list)

    @property
    def position(self) -> str:
        return f"epoch {self.epoch}, batch {self.batch} (step {self.global_step})"

    def describe(self) -> str:
        """``simplenet on digits, batch 64, 4 epochs, at epoch 2, batch 0 (step 46)``, for messages."""
        i = self.identity
        asked = f", {self.epochs} epoch{'s' * (self.epochs != 1)}" if self.epochs is not None else ""
        return (
            f"{i.get('model')} on {i.get('dataset')}, batch {i.get('batch_size')}, seed {i.get('seed')}{asked}, "
            f"at {self.position}"
        )


def read_saved_run(path: Path) -> SavedRun:
    """The run a checkpoint belongs to (a file is read and verified whole; a sharded checkpoint's index only).

    Raises:
        CheckpointError: the file is damaged or was not written by ``paratrain train``.
    """
    state = read_plain(path)
    missing = [key for key in ("epoch", "batch", "global_step", "config") if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no {missing[0]!r} entry; it was not written by paratrain train")
    run = state.get("run") or {}
    return SavedRun(
        path=path,
        epoch=int(state["epoch"]),
        batch=int(state["batch"]),
        global_step=int(state["global_step"]),
        identity=dict(state["config"]),
        epochs=run.get("epochs", state["config"].get("epochs")),
        metrics_out=run.get("metrics_out"),
        epoch_losses=[float(x) for x in run.get("epoch_losses", [])],
        epoch_test_accuracy=[float(x) for x in run.get("epoch_test_accuracy", [])],
    )


@dataclass(frozen=True)
class Start:
    """Where a run starts: ``path`` None is from scratch; ``complete``: its checkpoint is at ``--epochs`` already."""

    path: Path | None
    saved: SavedRun | None
    epochs: int  # the epochs this run is asked for

    @property
    def complete(self) -> bool:
        return self.saved is not None and self.saved.epoch >= self.epochs

    def complete_message(self) -> str:
        """What a complete run says instead of training (and instead of a summary of nothing)."""
        saved = self.saved
        assert saved is not None
        trained = saved.epoch
        of = (
            f"{trained} of {self.epochs} epochs"
            if trained == self.epochs
            else f"{trained} epochs, more than the {self.epochs} asked for"
        )
        last = []
        if saved.epoch_test_accuracy:
            last.append(f"test accuracy {saved.epoch_test_accuracy[-1]:.2%}")
        if saved.epoch_losses:
            last.append(f"train loss {saved.epoch_losses[-1]:.4f}")
        scores = f" ({', '.join(last)} after its last epoch)" if last else ""
        metrics = f"; its metrics were written to {saved.metrics_out}" if saved.metrics_out else ""
        return (
            f"The run in {saved.path.parent} is complete: it trained {of}{scores}. Its final checkpoint is "
            f"{saved.path}{metrics}. Nothing to train: give --epochs larger than {trained} to train it further"
        )


def plan_start(config: TrainConfig, checkpoints: Path | None, continuing: bool) -> Start:
    """Where ``config``'s run starts (see the module docstring); checked before any work starts.

    Raises:
        ConfigError: a new run into a directory holding another run's checkpoints, or a checkpoint whose run
            these settings cannot continue (each differing setting named).
        CheckpointError: ``--resume`` and no checkpoint to resume, or a damaged one.
    """
    latest = latest_checkpoint(checkpoints) if checkpoints is not None and checkpoints.is_dir() else None
    if continuing and latest is not None:
        # the launcher restarted this worker after a failure: continue from the newest checkpoint, which may be
        # newer than the one the first attempt resumed from
        return Start(latest, read_saved_run(latest), config.epochs)
    if config.resume is None:
        if latest is not None:
            assert checkpoints is not None
            _refuse_new_run(config, checkpoints, read_saved_run(latest))
        return Start(None, None, config.epochs)
    if config.resume in RESUME_MODES:
        if latest is None:
            if config.resume == "if-exists":
                return Start(None, None, config.epochs)
            raise CheckpointError(
                f"--resume: no checkpoint in {checkpoints}; drop --resume to start from scratch, or use "
                f"--resume if-exists to start from scratch only when there is none"
            )
        saved = read_saved_run(latest)
        _check_continues(config, saved)
        return Start(latest, saved, config.epochs)
    path = Path(config.resume)
    if not (path.is_file() or is_sharded_checkpoint(path)):
        raise CheckpointError(f"--resume {config.resume}: no such checkpoint file (or sharded checkpoint directory)")
    saved = read_saved_run(path)
    _check_continues(config, saved)
    if latest is not None and latest.resolve() != path.resolve():
        _refuse_other_checkpoints(config, path, latest)  # rewinding the same run (an earlier checkpoint) is fine
    return Start(path, saved, config.epochs)


def _refuse_new_run(config: TrainConfig, checkpoints: Path, saved: SavedRun) -> None:
    count = len(list_checkpoints(checkpoints))
    differ = differences(saved.identity, config)
    resume = f"resume it with its own settings (these differ: {'; '.join(differ)})" if differ else "add --resume"
    raise ConfigError(
        f"--checkpoint-dir {checkpoints} holds another run's checkpoints ({count}, the latest "
        f"{saved.path.name}: {saved.describe()}); a new run there would replace and prune them. To continue that "
        f"run, {resume}; to start a new one, give another --checkpoint-dir (or move those files away)"
    )


def _check_continues(config: TrainConfig, saved: SavedRun) -> None:
    differ = differences(saved.identity, config)
    if differ:
        raise ConfigError(
            f"--resume: checkpoint {saved.path} belongs to a run these settings cannot continue: {'; '.join(differ)}. "
            f"Resume with the checkpoint's settings, or start a new run in another --checkpoint-dir"
        )


def _refuse_other_checkpoints(config: TrainConfig, path: Path, latest: Path) -> None:
    """Resuming from a file into a directory of checkpoints: the same run's (rewinding it) is fine, another's not."""
    other = read_saved_run(latest)
    differ = differences(other.identity, config)
    if differ:
        raise ConfigError(
            f"--resume {path}: --checkpoint-dir {latest.parent} holds another run's checkpoints (the latest "
            f"{latest.name}: {other.describe()}; {'; '.join(differ)}), which this run's would replace and prune. "
            f"Give another --checkpoint-dir for the run resumed from {path.name}"
        )
