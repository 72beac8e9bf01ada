"""The README and the docs are true of the repository: the files their commands run exist, and a newcomer is told
where the command is and how to install into an environment of their own."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
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


def _layout_doc():
    spec = importlib.util.spec_from_file_location("layout_doc", ROOT / "scripts" / "layout_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layout_page_maps_every_module_as_the_tree_has_it():
    layout = _layout_doc()
    page = (ROOT / "docs" / "layout.md").read_text()
    assert layout.current_map(page) == layout.module_map(), (
        "docs/layout.md's module map differs from the tree: run `python scripts/layout_doc.py --write`"
    )


REFERRING = [*PAGES, *sorted((ROOT / "examples").glob("*.py"))]
DOTTED = re.compile(r"(?<![\w.])paratrain(?:\.[A-Za-z_]\w*)+")
PATHS = re.compile(
    r"(?<![\w/.-])((?:src/)?paratrain/[\w/]+\.py|(?:tests|benchmarks|scripts|examples|docs)/[\w/-]+\.(?:py|md))"
)


def _resolves(dotted: str) -> bool:
    """Is ``dotted`` a module of ours, or a name in one (``paratrain.ddp.reducer.Reducer``, ``paratrain.Parallel``)?"""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            target = importlib.import_module(name)
            for attr in parts[cut:]:
                if not hasattr(target, attr):
                    return False
                target = getattr(target, attr)
            return True
    return False


@pytest.mark.parametrize("page", REFERRING, ids=[p.name for p in REFERRING])
def test_the_modules_and_files_a_page_names_exist(page):
    text = page.read_text()
    modules = sorted({m for m in DOTTED.findall(text) if not _resolves(m)})
    files = sorted(
        f
        for f in set(PATHS.findall(text))
        if not (ROOT / (f if not f.startswith("paratrain/") else f"src/{f}")).is_file()
    )
    assert (modules, files) == ([], []), f"{page.name} names modules {modules} and files {files} that do not exist"


def _blocks(page: str, language: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.processes  # bash -n
def test_the_launcher_pages_sbatch_script_is_valid_bash_that_runs_paratrain_under_srun():
    [script] = [b for b in _blocks("launcher.md", "bash") if "#SBATCH" in b]
    assert (
        script.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in script and "#SBATCH --ntasks-per-node=" in script
    )
    checked = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "srun paratrain train" in script and "srun python train.py" in script


def test_the_launcher_pages_pytorchjob_manifest_is_valid_yaml_with_a_master_and_workers_running_paratrain():
    yaml = pytest.importorskip("yaml")
    [manifest] = [yaml.safe_load(b) for b in _blocks("launcher.md", "yaml") if "PyTorchJob" in b]
    assert manifest["kind"] == "PyTorchJob" and manifest["apiVersion"].startswith("kubeflow.org/")
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for spec in replicas.values():
        [container] = spec["template"]["spec"]["containers"]
        assert container["command"][:2] == ["paratrain", "train"]
