"""The public surface, and the line between the engine and the application built on it."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain
from paratrain.cli import build_parser
from paratrain.launch.launcher import LaunchConfig
from paratrain.settings import flag_of
from paratrain.tools import BenchConfig, PlanConfig, VerifyConfig
from paratrain.training import TrainConfig

PACKAGE = Path(paratrain.__file__).parent
APPLICATION = ("training", "cli", "tools")
# beside the engine but not of it: `python -m paratrain` (the command line's entry point)
NOT_ENGINE = ("__main__.py",)


def test_public_api_is_explicit():
    assert "DataParallel" in paratrain.__all__
    for name in paratrain.__all__:
        assert hasattr(paratrain, name), name
    public = {n for n in dir(paratrain) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(paratrain, n)).__name__ == "module"}
    assert public - modules == set(paratrain.__all__) - {"__version__"}


@pytest.mark.processes
def test_tools_load_on_first_use_only():
    # paratrain.verify/bench/plan come from the application's tools package, imported by __getattr__ when asked
    code = (
        "import sys, json, paratrain; before = 'paratrain.tools' in sys.modules; f = paratrain.verify; "
        "print(json.dumps([before, 'paratrain.tools' in sys.modules, f.__module__]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [False, True, "paratrain.tools.verify"]
    for name in ("verify", "bench", "plan"):
        assert callable(getattr(paratrain, name)) and name in dir(paratrain)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        paratrain.nonsense  # noqa: B018


@pytest.mark.processes
def test_import_paratrain_loads_the_engine_only():
    code = "import sys, json, paratrain; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    ours = [m for m in loaded if m.startswith("paratrain")]
    assert "paratrain.ddp.distributed" in ours and "paratrain.parallel" in ours  # the check can see our modules
    application = [m for m in ours if m.split(".")[1:2] and m.split(".")[1] in (*APPLICATION, "models")]
    assert application == []


def _engine_modules() -> list[Path]:
    """Every module of the engine: the package less the application's subpackages and the entry point."""
    files = [f for f in PACKAGE.rglob("*.py") if f.relative_to(PACKAGE).parts[0] not in APPLICATION]
    return sorted(f for f in files if f.name not in NOT_ENGINE or f.parent != PACKAGE)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``, relative ones resolved against its package."""
    package = [PACKAGE.name, *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([target] if target else []))
            found += [(node.lineno, target)] + [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_the_engine_is_found_in_its_subpackages():
    names = {str(p.relative_to(PACKAGE)) for p in _engine_modules()}
    assert {"parallel.py", "ddp/reducer.py", "sharded/zero.py", "strategies/base.py", "launch/torchrun.py"} <= names
    assert not any(n.startswith(APPLICATION) for n in names)


@pytest.mark.parametrize("path", _engine_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_code_never_imports_the_application(path):
    for line, name in _imported(path):
        parts = name.split(".")
        assert not (parts[0] == "paratrain" and parts[1:2] and parts[1] in APPLICATION), f"{path.name}:{line} {name}"


# Each layer of the engine and the layers it may import, lowest first: the foundation (errors, settings, the
# environment, devices, trees, files: the modules directly in paratrain/) imports none of the others; diagnostics
# and comm sit below ddp, ddp below sharded, the strategies above them, the loop above the strategies, Parallel on
# top. A subpackage that reaches upwards (the reducer importing a strategy, say) fails here, named.
LAYERS: dict[str, set[str]] = {
    "foundation": set(),
    "diagnostics": {"foundation"},
    "checkpoint": {"foundation"},
    "launch": {"foundation", "diagnostics"},
    "dp": {"foundation", "diagnostics"},
    "comm": {"foundation", "diagnostics"},
    "ddp": {"foundation", "diagnostics", "comm"},
    "sharded": {"foundation", "diagnostics", "comm", "ddp", "checkpoint"},
    "strategies": {"foundation", "diagnostics", "comm", "dp", "ddp", "sharded", "checkpoint"},
    "loop": {"foundation", "diagnostics", "comm", "dp", "ddp", "sharded", "checkpoint", "strategies"},
    "parallel": {"foundation", "diagnostics", "comm", "dp", "ddp", "sharded", "checkpoint", "strategies", "loop"},
}
TOP = {"parallel.py": "parallel", "__init__.py": "api"}


def _layer(relative: Path) -> str:
    if len(relative.parts) == 1:
        return TOP.get(relative.name, "foundation")
    return relative.parts[0]


def _layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "paratrain" or len(parts) == 1:
        return None
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return TOP.get(f"{parts[1]}.py", "foundation") if (PACKAGE / f"{parts[1]}.py").exists() else None


def test_every_subpackage_of_the_engine_has_a_layer():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - set(APPLICATION)
    assert subpackages == set(LAYERS) - {"foundation", "parallel"}


@pytest.mark.parametrize("path", _engine_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_engine_depends_one_way_layer_by_layer(path):
    layer = _layer(path.relative_to(PACKAGE))
    if layer == "api":
        return  # the package's __init__ re-exports the public names from every layer
    allowed = LAYERS[layer] | {layer}
    for line, name in _imported(path):
        target = _layer_of_module(name)
        assert target is None or target in allowed, (
            f"{path.relative_to(PACKAGE)}:{line} imports {name}: the {layer} layer may import only {sorted(allowed)}"
        )


@pytest.mark.parametrize(
    "settings, command",
    [
        (TrainConfig, "train"),
        (LaunchConfig, "train"),
        (LaunchConfig, "launch"),
        (VerifyConfig, "verify"),
        (BenchConfig, "bench"),
        (PlanConfig, "plan"),
    ],
)
def test_every_setting_has_its_flag_with_its_default(settings, command):
    parser = build_parser()
    subparser = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    actions = {action.dest: action for action in subparser._actions}
    for field in dataclasses.fields(settings):
        assert field.name in actions, f"{settings.__name__}.{field.name} has no flag in `paratrain {command}`"
        action = actions[field.name]
        assert flag_of(field.name) in action.option_strings
        assert action.default == field.default, field.name
        assert action.help and field.metadata["help"].split(" (default")[0] in action.help.replace("%%", "%")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every paratrain module -> the paratrain modules it imports anywhere (in functions and TYPE_CHECKING too)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [f"{target}.{alias.name}" for alias in node.names] + [target]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            for candidate in candidates:
                if candidate in modules and candidate != name:
                    graph[name].add(candidate)
                    break
    return graph


def test_the_import_graph_has_no_cycle():
    """No two modules import each other, directly or around a loop, not even for type hints only."""
    graph = _import_graph()
    assert "paratrain.training.mnist" in graph["paratrain.training.datasets"]  # the graph sees lazy imports
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        for target in sorted(graph[module]):
            # a package's __init__ importing its own modules is how a package is made, not a cycle
            if module.startswith(target + "."):
                continue
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


TENSOR_MAKERS = {"tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "as_tensor", "from_numpy"}


def path_tensors(path: Path) -> list[ast.stmt]:
    """Module-level statements of ``path`` that make a torch tensor (``torch.empty(0)``, ``torch.zeros(...)``)."""
    made = []
    for node in ast.parse(path.read_text()).body:
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Call):
            func = value.func
            if isinstance(func, ast.Attribute) and func.attr in TENSOR_MAKERS:
                root = func.value
                if isinstance(root, ast.Name) and root.id == "torch":
                    made.append(node)
    return made


def test_the_tensor_check_sees_a_module_level_tensor(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n_EMPTY = torch.empty(0)\nLIMIT: int = 3\n")
    assert [n.lineno for n in path_tensors(probe)] == [2]


def test_the_engine_keeps_no_mutable_state_at_module_level():
    """Lists, dicts, sets and counters of the engine live on the objects that own them (constants are CAPITALS)."""
    mutable_calls = {"list", "dict", "set", "count", "defaultdict", "OrderedDict", "WeakKeyDictionary"}
    found = []
    for path in _engine_modules():
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            value = getattr(node, "value", None)
            for target in targets:
                if not isinstance(target, ast.Name) or target.id.isupper() or target.id == "__all__":
                    continue
                call = value.func if isinstance(value, ast.Call) else None
                called = getattr(call, "attr", getattr(call, "id", None))
                if isinstance(value, (ast.List, ast.Dict, ast.Set)) or called in mutable_calls:
                    found.append(f"{path.name}:{node.lineno} {target.id}")
        # a tensor is mutable state whatever its name's case: one object shared by every caller (and device)
        found += [f"{path.name}:{node.lineno} a tensor" for node in path_tensors(path)]
        found += [
            f"{path.name}:{n.lineno} global" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Global)
        ]
    assert found == [], found
