"""``python -m paratrain``: the same as the ``paratrain`` command."""

from __future__ import annotations

import sys

from paratrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
