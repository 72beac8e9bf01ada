"""``python -m paratrain._script [-m] SCRIPT [ARGS]``: run SCRIPT as ``python SCRIPT ARGS`` would (with ``-m``, the
module, as ``python -m``), and record the exception that ends it where torchrun collects each rank's error.

:func:`paratrain.launch.launch` starts every worker through this module, so that a failed job's summary can give
each failed rank's error (:mod:`paratrain.failures`) without the script using torch's ``@record`` decorator. The
script sees what it would see started directly: ``__name__ == "__main__"``, its own ``__file__``, ``sys.argv``
from its path on, and its directory first on ``sys.path``; its traceback is printed as Python prints it.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from .failures import record_error


def main() -> None:
    args = sys.argv[1:]
    module = args[:1] == ["-m"]
    if module:
        args = args[1:]
    if not args:
        print("usage: python -m paratrain._script [-m] SCRIPT [ARGS]", file=sys.stderr)
        sys.exit(2)
    target = args[0]
    sys.argv = list(args)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` puts it
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        record_error(f"{type(exc).__name__}: {exc}")
        # the traceback Python would print for the script run directly: without this module's and runpy's frames
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
