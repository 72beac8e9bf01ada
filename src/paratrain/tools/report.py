"""Writing what the tools found: aligned text tables, Markdown tables, JSON files written atomically."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.files import atomic_writer

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
    """Write ``text`` atomically, never over a device or a link (see :mod:`paratrain.files`)."""
    try:
        with atomic_writer(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}; pick a writable path") from exc
    return Path(path)


def write_json(payload: dict[str, Any], path: str | Path) -> Path:
    return write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n", path)
