"""One rank of ``paratrain train --strategy ddp``, started by the launcher that ``paratrain train`` became.

    python -m torch.distributed.run --nproc-per-node 2 -m paratrain.training.worker JOB.json

JOB.json holds the run's settings (``{"config": TrainConfig.to_dict(), "launch": LaunchConfig.to_dict()}``), written by
:func:`paratrain.training.command.launch_train`. Errors are reported as the command reports them (one line,
exit 2 for a usage error, 1 for a runtime error) and recorded for the launcher's summary; a run stopped by
Ctrl-C exits 130 (rank 0 said where it stopped); a closed stdout ends the rank quietly with 141.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from paratrain.diagnostics.stacks import drop_unused_dump
from paratrain.environment import ClusterEnvironment
from paratrain.errors import CollectiveError, ConfigError, ParatrainError, TrainingInterrupted
from paratrain.launch.config import LaunchConfig
from paratrain.launch.failures import first_to_show, record_error
from paratrain.training.config import TrainConfig
from paratrain.training.job import train
from paratrain.training.progress import stdout_closed

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def main(argv: list[str]) -> int:
    try:
        job = json.loads(Path(argv[0]).read_text())
        config = TrainConfig.from_dict(job["config"], source=argv[0])
        launcher = LaunchConfig.from_dict(job["launch"], source=argv[0]) if "launch" in job else None
        train(config, launcher=launcher)
    except ConfigError as exc:
        return _failed(exc, EXIT_USAGE)
    except CollectiveError as exc:
        _failed(exc, EXIT_RUNTIME)
        # a collective that will never complete: the interpreter's teardown would wait for it (gloo waits its own
        # timeout), keeping the whole job alive; leave now, so the launcher stops the others
        _leave(EXIT_RUNTIME)
    except ParatrainError as exc:
        return _failed(exc, EXIT_RUNTIME)
    except TrainingInterrupted:
        _leave(EXIT_INTERRUPTED)  # every rank stopped after the same step; rank 0 said where, and what it saved
    except KeyboardInterrupt:
        if ClusterEnvironment.detect().rank == 0:  # every rank got the signal: one line is enough
            print("paratrain train: interrupted", file=sys.stderr)
        _leave(EXIT_INTERRUPTED)
    except BrokenPipeError:
        _leave(stdout_closed())
    # A worker whose job is done (results written, process group destroyed, our threads joined) leaves without
    # the interpreter's teardown. Native threads that outlive it (gloo's, the store's) may still drop the last
    # reference to a Python object then, which kills the process with SIGABRT ("terminate called without an active
    # exception") and turns a finished job into a failed one. The library avoids every such object it knows of
    # (process_groups.no_python_in_work); this is the worker's guard for the rest.
    _leave(0)


def _failed(exc: ParatrainError, code: int) -> int:
    message = f"paratrain train: error: {exc}"
    if first_to_show(message):  # once on this machine when every rank fails alike; the summary names each rank
        print(message, file=sys.stderr)
    summary = getattr(exc, "summary", None)  # a CollectiveError's short line: its diagnosis is printed just above
    record_error(f"paratrain train: error: {summary or exc}")  # the launcher's line for this rank quotes it
    return code


def _leave(code: int) -> NoReturn:
    drop_unused_dump()  # os._exit skips atexit, where the stack file would go
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
