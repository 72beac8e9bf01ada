"""docs/layout.md's module map, made from the modules themselves: every module with its docstring's first sentence.

    python scripts/layout_doc.py           # print the map
    python scripts/layout_doc.py --write   # write it into docs/layout.md, between its two marker lines

tests/test_docs.py fails while the page's map differs from the tree, naming this command.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "paratrain"
PAGE = ROOT / "docs" / "layout.md"
START, END = "<!-- module map: start (scripts/layout_doc.py --write) -->", "<!-- module map: end -->"
# the engine's layers from the bottom up (tests/test_api.py holds what each may import), then the application
ORDER = ("", "diagnostics", "checkpoint", "launch", "dp", "comm", "ddp", "sharded", "strategies", "loop",
         "training", "tools", "cli")  # fmt: skip
NAME_WIDTH = 24
WIDTH = 118


def purpose(path: Path) -> str:
    """The docstring's first sentence (its first paragraph where no sentence ends there)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = re.match(r"(.+?[.?!])(\s|$)", paragraph)
    text = sentence.group(1) if sentence else paragraph
    return text.rstrip(".")


def module_map() -> str:
    packages = sorted({p.parent for p in PACKAGE.rglob("*.py")}, key=lambda d: ORDER.index(_rel(d)))
    lines = []
    for directory in packages:
        rel = _rel(directory)
        lines.append(f"src/paratrain/{rel + '/' if rel else ''}")
        modules = sorted(directory.glob("*.py"), key=lambda p: (p.name != "__init__.py", p.name))
        for module in modules:
            text = textwrap.wrap(purpose(module), WIDTH - NAME_WIDTH - 2) or ["(no docstring)"]
            lines.append(f"  {module.name:<{NAME_WIDTH}}{text[0]}")
            lines += [" " * (NAME_WIDTH + 2) + more for more in text[1:]]
    return "```\n" + "\n".join(lines) + "\n```"


def _rel(directory: Path) -> str:
    return "" if directory == PACKAGE else directory.relative_to(PACKAGE).as_posix()


def current_map(page: str) -> str:
    if START not in page or END not in page:
        raise SystemExit(f"{PAGE} has no module map between {START!r} and {END!r}")
    return page.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the map into docs/layout.md")
    args = parser.parse_args(argv)
    made = module_map()
    if not args.write:
        print(made)
        return 0
    page = PAGE.read_text()
    before, rest = page.split(START, 1)
    after = rest.split(END, 1)[1]
    PAGE.write_text(f"{before}{START}\n{made}\n{END}{after}")
    print(f"wrote the module map of {made.count(chr(10)) - 1} lines into {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
