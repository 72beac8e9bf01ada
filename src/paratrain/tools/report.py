"""Writing what the tools found: aligned text tables, Markdown tables, JSON files written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["format_markdown", "format_table", "write_json", "write_text"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, a rule under the headers."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def format_markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_text(text: str, path: str | Path) -> Path:
    """Write ``text`` atomically (a reader never sees half a file)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc.strerror}; pick a writable path") from exc
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_json(payload: dict[str, Any], path: str | Path) -> Path:
    return write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n", path)
