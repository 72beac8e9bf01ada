"""The README and the docs are true of the repository: the files their commands run exist, and a newcomer is told
where the command is and how to install into an environment of their own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _code(page: Path) -> str:
    return "\n".join(re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), flags=re.S))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_script_a_command_runs_is_in_the_repository(page):
    scripts = set(re.findall(r"(?<![\w/.-])((?:examples|benchmarks|scripts|tests)/[\w/.-]+\.py)", _code(page)))
    missing = sorted(s for s in scripts if not (ROOT / s).is_file())
    assert not missing, f"{page.name} runs {missing}, which the repository does not have"


def test_the_readmes_launch_commands_run_a_script_of_the_repository():
    launches = [line for line in _code(ROOT / "README.md").splitlines() if line.startswith("paratrain launch")]
    assert launches and all("examples/mnist_parallel.py" in line for line in launches), launches


def test_the_readme_says_where_the_command_is_and_how_to_install_it_elsewhere():
    readme = (ROOT / "README.md").read_text()
    assert "`.venv/bin/paratrain`" in readme and "pip install -e ." in readme
