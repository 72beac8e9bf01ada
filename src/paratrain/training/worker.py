"""One rank of ``paratrain train --strategy ddp``, started by the launcher that ``paratrain train`` became.

    python -m torch.distributed.run --nproc-per-node 2 -m paratrain.training.worker JOB.json

JOB.json holds the run's settings (``{"config": TrainConfig.to_dict()}``), written by
:func:`paratrain.training.command.launch_train`. Errors are reported as the command reports them (one line,
exit 2 for a usage error, 1 for a runtime error).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

from ..errors import CollectiveError, ConfigError, ParatrainError
from .config import TrainConfig
from .job import train

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def main(argv: list[str]) -> int:
    try:
        config = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text())["config"], source=argv[0])
        train(config)
    except ConfigError as exc:
        print(f"paratrain train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CollectiveError as exc:
        print(f"paratrain train: error: {exc}", file=sys.stderr)
        # a collective that will never complete: the interpreter's teardown would wait for it (gloo waits its own
        # timeout), keeping the whole job alive; leave now, so the launcher stops the others
        _leave(EXIT_RUNTIME)
    except ParatrainError as exc:
        print(f"paratrain train: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("paratrain train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    # A worker whose job is done (results written, process group destroyed, our threads joined) leaves without
    # the interpreter's teardown. Native threads that outlive it (gloo's, the store's) may still drop the last
    # reference to a Python object then, which kills the process with SIGABRT ("terminate called without an active
    # exception") and turns a finished job into a failed one. The library avoids every such object it knows of
    # (collectives.no_python_in_work); this is the worker's guard for the rest.
    _leave(0)


def _leave(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
