"""The exceptions paratrain raises.

Every error a user can cause says what was expected, what was found, and what to do. Each type also
derives from the builtin that code written against PyTorch would catch (``ValueError`` for bad arguments,
``RuntimeError`` for failures while running), so ``except ValueError`` keeps working::

    ParatrainError
    ├── ConfigError (ValueError)          bad arguments: devices, sizes, flags, names
    │   └── DeviceError                   a device that does not exist or does not fit
    ├── ScatterError (ValueError)         inputs that cannot be split across replicas
    ├── GatherError (ValueError)          replica outputs that cannot be put back together
    ├── ReplicaError (RuntimeError)       one or more replicas failed; names each replica and device
    ├── DataError (RuntimeError)          missing or corrupt dataset files
    ├── CheckpointError (RuntimeError)    unreadable, corrupt or incompatible checkpoints
    ├── DistributedError (RuntimeError)   ranks that disagree, or a collective that did not complete
    │   └── CollectiveError               a collective that timed out or failed: its group is unusable now
    └── TrainingError (RuntimeError)      a run that cannot go on meaningfully (its loss became nan or inf)

    TrainingInterrupted (KeyboardInterrupt)   an interrupted run stopped at a step, its state saved
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "DeviceError",
    "DistributedError",
    "GatherError",
    "ParatrainError",
    "ReplicaError",
    "ScatterError",
    "TrainingError",
    "TrainingInterrupted",
]


class ParatrainError(Exception):
    """Base class of every exception paratrain raises on purpose."""


class ConfigError(ParatrainError, ValueError):
    """An argument, flag or name is not one paratrain can use."""


class DeviceError(ConfigError):
    """A device that does not exist, cannot be used, or holds the wrong thing."""


class ScatterError(ParatrainError, ValueError):
    """The inputs cannot be split along the batch dimension."""


class GatherError(ParatrainError, ValueError):
    """The replicas' outputs cannot be gathered into one result."""


class ReplicaError(ParatrainError, RuntimeError):
    """One or more replicas raised; used when the original exception type cannot be rebuilt."""


class DataError(ParatrainError, RuntimeError):
    """A dataset's files are missing, unreadable or corrupt."""


class CheckpointError(ParatrainError, RuntimeError):
    """A checkpoint cannot be written, read, or does not match what it is loaded into."""


class DistributedError(ParatrainError, RuntimeError):
    """Ranks disagree, or a collective did not complete in time."""


class CollectiveError(DistributedError):
    """A collective timed out or failed: the process group holds work that will never complete.

    Nothing may wait on that group afterwards (tearing it down would wait for the lost collective): leave the
    process, and the launcher stops the others.

    The message is the whole diagnosis; ``summary`` is one short line pointing to it, which the launcher's
    summary of a failed job quotes instead (the diagnosis is on the console once). ``backend_error`` is the
    backend's own exception (gloo's "Connection closed by peer"), whose text the message already quotes.
    """

    def __init__(self, message: str, summary: str | None = None, backend_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.summary = summary
        self.backend_error = backend_error


class TrainingError(ParatrainError, RuntimeError):
    """Training cannot go on meaningfully: the loss became nan or inf."""


class TrainingInterrupted(KeyboardInterrupt):
    """A run that was interrupted (Ctrl-C) stopped at a step boundary, saved where it was and said so.

    A ``KeyboardInterrupt``, so that code which lets Ctrl-C through lets this through too.
    """
