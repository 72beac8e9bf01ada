"""``python -m paratrain.launch.script [-m] SCRIPT [ARGS]``: run SCRIPT as ``python SCRIPT ARGS`` would (with
``-m``, the module, as ``python -m``), and record what ended it where torchrun collects each rank's error.

:func:`paratrain.launch.launcher.launch` starts every worker through this module, so that a failed job's summary can
give each failed rank's error (:mod:`paratrain.launch.failures`) without the script using torch's ``@record``
decorator: an exception's type and message, or for ``sys.exit(N)`` the last line the script wrote to stderr. The
script sees what it would see started directly: ``__name__ == "__main__"``, its own ``__file__``, ``sys.argv`` from
its path on, and its directory first on ``sys.path``; its traceback is printed as Python prints it, once on each
machine when several ranks fail with the same one (:func:`~paratrain.launch.failures.first_to_show`). Ctrl-C
(which the launcher passes to every rank) ends it with 130 without a traceback per rank.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Any, TextIO

from paratrain.launch.failures import error_line, first_to_show, record_error

_EXIT_INTERRUPTED = 130


class _LastLine:
    """``sys.stderr``, remembering the last non-empty line written through it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.last = ""

    def write(self, text: str) -> int:
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            self.last = lines[-1].strip()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main() -> None:
    args = sys.argv[1:]
    module = args[:1] == ["-m"]
    if module:
        args = args[1:]
    if not args:
        print("usage: python -m paratrain.launch.script [-m] SCRIPT [ARGS]", file=sys.stderr)
        sys.exit(2)
    target = args[0]
    sys.argv = list(args)
    stderr = _LastLine(sys.stderr)
    sys.stderr = stderr  # type: ignore[assignment]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` puts it
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, str):
            record_error(exc.code)
        elif exc.code not in (None, 0):
            record_error(stderr.last or f"sys.exit({exc.code})")
        raise
    except KeyboardInterrupt:
        sys.exit(_EXIT_INTERRUPTED)
    except BaseException as exc:
        record_error(error_line(exc))
        # the traceback Python would print for the script run directly: without this module's and runpy's frames;
        # once per machine when every rank fails alike (the launcher's summary names each failed rank)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        if first_to_show(text):
            sys.stderr.write(text)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
