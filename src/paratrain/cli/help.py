"""How ``--help`` texts are laid out: paragraphs wrapped to the terminal, example lines kept as written."""

from __future__ import annotations

import argparse
import textwrap

__all__ = ["ExamplesFormatter"]


class ExamplesFormatter(argparse.HelpFormatter):
    """Wraps description and epilog paragraphs like argparse's default; keeps indented lines (examples) as they
    are, where the default would join them into one paragraph and the raw formatter would wrap nothing."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        paragraph: list[str] = []

        def flush() -> None:
            if paragraph:
                out.append(textwrap.fill(" ".join(paragraph), width, initial_indent=indent, subsequent_indent=indent))
                paragraph.clear()

        for line in text.splitlines():
            if line.startswith(" ") or not line.strip():
                flush()
                out.append(indent + line)
            else:
                paragraph.append(line.strip())
        flush()
        return "\n".join(out)
