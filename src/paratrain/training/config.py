"""Every setting of a training run: the shared groups (model, data, optimizer, step) and the run's own.

``paratrain train``'s flags are generated from :class:`TrainConfig` (``--batch-size`` is ``batch_size``), so a flag
cannot drift from its default, its help or its check. The defaults are the classic MNIST DataParallel tutorial's
job: SimpleNet, batch 64, SGD with learning rate 0.01, 5 epochs.

    config = TrainConfig(epochs=1, strategy="dp", devices="cpu,cpu,cpu")
    config.check()                 # ConfigError naming the flag, before any work starts
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.checkpoint.formats import require_safetensors
from paratrain.ddp.options import DDPOptions
from paratrain.errors import ConfigError
from paratrain.files import check_output
from paratrain.settings import at_least, finite_positive, one_of, optional, setting
from paratrain.strategies import STRATEGY_NAMES
from paratrain.training.logs import check_extras
from paratrain.training.optimizers import LR_SCHEDULES
from paratrain.training.settings import CollectiveSettings, DataSettings, ModelSettings, OptimizerSettings, StepSettings
from paratrain.training.trackers import LOG_DIR_OUTPUTS, LOG_WITH, TRACKERS, check_trackers
from paratrain.training.user_data import DATA_SPEC_HELP, check_data_spec

__all__ = ["RESUME_MODES", "TrainConfig"]

RESUME_MODES = ("latest", "if-exists")


@dataclass
class TrainConfig(CollectiveSettings, StepSettings, OptimizerSettings, DataSettings, ModelSettings):
    """Every setting of a training run; the defaults are the classic MNIST DataParallel tutorial's job."""

    data: str | None = setting(None, DATA_SPEC_HELP, metavar="module:callable")
    epochs: int = setting(5, "passes over the training data", check=at_least(1))
    lr_schedule: str = setting(
        "constant",
        "constant, or cosine decay to 0 over the run's optimizer steps",
        check=one_of(LR_SCHEDULES),
        choices=LR_SCHEDULES,
    )
    warmup_steps: int = setting(
        0, "raise the learning rate linearly from 0 over the first N steps", check=at_least(0), metavar="N"
    )
    log_every: int = setting(
        100,
        "print the log line every N steps: loss, gradient norm, learning rate, samples/s, step time, memory, FLOP/s",
        check=at_least(1),
        metavar="N",
    )
    strategy: str = setting(
        "auto",
        "how to run: single (one device), dp (several devices, one process), ddp (one process per device), "
        "zero1 / zero2 (as ddp, with the optimizer state / and the gradients sharded across the processes), zero3 "
        "(and the weights too: fully sharded); "
        "auto: ddp under a launcher or over several GPUs, dp over a list of devices, else single",
        check=one_of(STRATEGY_NAMES),
        choices=STRATEGY_NAMES,
    )
    devices: str = setting("auto", "auto, cpu, cuda, cuda:0,cuda:1, or cpu,cpu,cpu (CPU replicas)")
    find_unused_parameters: bool = setting(
        False,
        "ddp, zero1, zero2: parameters that get no gradient in a step (a branch the model skips) take part with "
        "zeros, instead of an error",
    )
    static_graph: bool = setting(
        False,
        "ddp, zero1, zero2: the same parameters take part in every step, each as often (learnt in the first "
        "step and trusted after: unused parameters without the per-step search)",
    )
    bucket_cap_mb: float | None = setting(
        None,
        "ddp, zero1, zero2: the largest gradient bucket, in MiB (default 25)",
        check=optional(finite_positive),
        metavar="MIB",
    )
    checkpoint_dir: str | None = setting(None, "save a checkpoint there at the end of every epoch", metavar="DIR")
    checkpoint_every: int = setting(
        0, "also save every N steps (0: only at epoch ends)", check=at_least(0), metavar="N"
    )
    keep_checkpoints: int = setting(3, "keep the newest K checkpoints", check=at_least(1), metavar="K")
    resume: str | None = setting(
        None,
        "continue from the latest checkpoint in --checkpoint-dir (an error if there is none), from it only if "
        "one exists (if-exists), or from a given file",
        nargs="?",
        const="latest",
        metavar="latest|if-exists|PATH",
    )
    init_from: str | None = setting(
        None,
        "start from these weights (a state dict .pt, a .safetensors file, a torch.distributed.checkpoint "
        "directory, or a paratrain checkpoint) instead of the seed's, under any strategy (zero3: each process reads "
        "its shards, a tensor at a time, never the whole model); a checkpoint --resume continues takes precedence "
        "(--resume if-exists: the file's weights until the run has a checkpoint)",
        metavar="FILE",
    )
    metrics_out: str | None = setting(None, "write the results as JSON", metavar="FILE.json")
    log_dir: str | None = setting(
        None,
        "write metrics.csv there, and TensorBoard event files and curves.png where their extras are installed "
        "(from rank 0 only)",
        metavar="DIR",
    )
    log_with: list[str] | None = setting(
        None,
        "with --log-dir: csv and tensorboard are --log-dir's own metrics.csv and event files (tensorboard then "
        "required); also log to these trackers: mlflow (a file store in DIR/mlruns, or MLFLOW_TRACKING_URI; "
        "needs paratrain[mlflow]), wandb (offline, in DIR/wandb; needs paratrain[wandb])",
        check=lambda names: None if names is None or set(names) <= set(LOG_WITH) else f"some of: {', '.join(LOG_WITH)}",
        nargs="+",
        metavar="TRACKER",
    )
    tensorboard: bool | None = setting(
        None,
        "with --log-dir, write TensorBoard event files (default: when paratrain[tensorboard] is installed; "
        "--tensorboard: required)",
    )
    plot: bool | None = setting(
        None, "with --log-dir, draw curves.png (default: when paratrain[plot] is installed; --plot: required)"
    )
    quiet: bool = setting(False, "no progress: no progress bar, no per-step lines, no per-phase lines (plan)")
    progress_bar: bool | None = setting(None, "show a progress bar (default: when stderr is a terminal)")
    max_steps: int | None = setting(
        None,
        "stop after N optimizer steps of this invocation, restarts included (smoke runs)",
        check=optional(at_least(1)),
        metavar="N",
    )
    eval_batch_size: int = setting(1024, "samples per batch when measuring test accuracy", check=at_least(1))

    @property
    def trackers(self) -> list[str]:
        """The experiment trackers ``--log-with`` names (not ``--log-dir``'s own files)."""
        return [name for name in self.log_with or () if name in TRACKERS]

    @property
    def writes_tensorboard(self) -> bool | None:
        """TensorBoard event files: True required (``--tensorboard``, ``--log-with tensorboard``), False off,
        None where the package is installed."""
        if self.tensorboard is None and "tensorboard" in (self.log_with or ()):
            return True
        return self.tensorboard

    @property
    def dataset_name(self) -> str:
        """The data the run uses: ``--data``'s callable, else the dataset named, else random or digits."""
        return self.data if self.data is not None else super().dataset_name

    def check_group(self) -> None:
        if self.data is not None:
            pairs = (("--dataset", self.dataset), ("--input-shape", self.input_shape))
            given = [f"{flag} {value}" for flag, value in pairs if value is not None]
            if given:
                raise ConfigError(
                    f"--data {self.data} and {' and '.join(given)} both say where the data comes from; give one of them"
                )
            check_data_spec(self.data)
        if self.log_with and self.log_dir is None:
            own = [name for name in self.log_with if name in LOG_DIR_OUTPUTS]
            what = "writes into" if own else "logs beside the files of"
            raise ConfigError(
                f"--log-with {' '.join(self.log_with)} {what} --log-dir, which has no default: add --log-dir DIR "
                f"(runs/a, say)"
            )
        if "tensorboard" in (self.log_with or ()) and self.tensorboard is False:
            raise ConfigError(
                "--log-with tensorboard asks for TensorBoard event files, --no-tensorboard for none: drop one"
            )
        check_trackers(self.trackers)
        for name, value in (("--tensorboard", self.tensorboard), ("--plot", self.plot)):
            if value and self.log_dir is None:
                raise ConfigError(f"{name} writes into --log-dir; add --log-dir DIR")
        if self.log_dir is not None:
            path = Path(self.log_dir)
            try:
                is_file = path.exists() and not path.is_dir()
            except OSError as err:  # a directory on the way this user may not search
                raise ConfigError(
                    f"--log-dir {self.log_dir}: {err.strerror or err}; this user cannot reach that path: choose a "
                    f"directory you can write to, or fix the permissions of the directories above it"
                ) from err
            if is_file:
                raise ConfigError(f"--log-dir {self.log_dir} is a file; give a directory (it is created if missing)")
            asked = "--tensorboard" if self.tensorboard else "--log-with tensorboard"
            check_extras(tensorboard=self.writes_tensorboard, plot=self.plot, tensorboard_flag=asked)
        if self.resume is not None and self.checkpoint_dir is None and self.resume in RESUME_MODES:
            raise ConfigError("--resume needs --checkpoint-dir (where to look for the latest checkpoint)")
        if self.init_from is not None:
            self._check_init_from(self.init_from)

    def _check_init_from(self, path: str) -> None:
        # with --resume, the checkpoint resumed from takes precedence (the run record's "continue it" line keeps
        # init-from and adds --resume); the job says that it left the file unread
        where = Path(path)
        if not where.exists() and not (where.suffix == ".pt" and where.with_suffix("").is_dir()):
            raise ConfigError(
                f"--init-from {path}: nothing is there; give a state dict (.pt), a .safetensors file, a DCP "
                f"directory or a paratrain checkpoint"
            )
        if where.suffix == ".safetensors":
            require_safetensors(f"--init-from {path}")

    def ddp_options(self) -> DDPOptions:
        """What ``--find-unused-parameters``, ``--static-graph`` and ``--bucket-cap-mb`` ask of the strategy."""
        return DDPOptions(
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            bucket_cap_mb=self.bucket_cap_mb,
        )

    def hang_report_path(self) -> str | None:
        """Where a hang report goes: ``--hang-report``, else beside the run's outputs (the checkpoint directory,
        the log directory, the metrics file's directory), else None (the current directory)."""
        if self.hang_report is not None:
            return self.hang_report
        for directory in (self.checkpoint_dir, self.log_dir):
            if directory is not None:
                return str(Path(directory) / "hang-report.json")
        if self.metrics_out is not None and Path(self.metrics_out).parent != Path("/dev"):
            return str(Path(self.metrics_out).parent / "hang-report.json")
        return None

    def check_outputs(self) -> None:
        """Check that every file and directory the run writes can be written, before any work starts.

        Called where the run's results are written: for a run on this machine before anything starts, and by
        the main process before its first step.

        Raises:
            ConfigError: naming the flag and what is wrong with its path.
        """
        if self.metrics_out is not None:
            check_output(self.metrics_out, "--metrics-out")
        if self.hang_report is not None:
            check_output(self.hang_report, "--hang-report")
        for flag, directory in (("--checkpoint-dir", self.checkpoint_dir), ("--log-dir", self.log_dir)):
            if directory is not None:
                check_output(Path(directory) / ".paratrain-check", flag)
