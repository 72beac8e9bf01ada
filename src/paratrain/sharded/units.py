"""How zero3 cuts a model into units: whole modules whose weights are gathered together, a pure function, table-tested.

    plan = plan_units(model)                               # the default policy
    plan = plan_units(model, units=[Block, "lm_head"])     # the user's: module classes and qualified names
    [u.name for u in plan]                                 # ["", "blocks.0", "blocks.1"]: "" is the root
    plan[1].params, plan[1].names                          # the parameters it holds, in registration order

A unit is a module; it holds the parameters of its subtree that no unit nested inside it holds. The root (the
model itself, named ``""``) is always a unit and holds the rest. The default policy makes a unit of every child of
a ``ModuleList`` or ``Sequential`` (the root included) that has at least ``min_params`` parameters, and does not
look inside those: the blocks of a transformer, the large layers of an MLP. A list given by the user names module
classes (every module of that class is a unit) and qualified module names (``"transformer.wte"``); units may nest.

A parameter used by modules of several units (tied weights: ``lm_head.weight is transformer.wte.weight``) is held
by the innermost unit that contains them all, usually the root, so it is gathered whenever either module runs.
Units that hold no parameter are left out (the root too, when the others hold everything). The plan is in
registration order, which is the forward order of most models; the weights' flat layout follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from paratrain.errors import ConfigError

__all__ = ["DEFAULT_MIN_PARAMS", "UnitPlan", "UnitSpec", "plan_units", "unit_names"]

DEFAULT_MIN_PARAMS = 1 << 16  # a block smaller than this is not worth a collective of its own: the root holds it

UnitSpec = Sequence[type[nn.Module] | str]


@dataclass(frozen=True)
class UnitPlan:
    """One unit: the module ``name`` (``""``: the root) and the parameters it holds."""

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    names: tuple[str, ...]  # each parameter's qualified name (the first, for a tied one)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _default_names(model: nn.Module, min_params: int) -> list[str]:
    chosen: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if container and _count(child) >= min_params:
                chosen.append(name)
            else:
                visit(f"{name}.", child)

    visit("", model)
    return chosen


def _named_units(model: nn.Module, units: UnitSpec) -> list[str]:
    modules = dict(model.named_modules())
    chosen: set[str] = set()
    for entry in units:
        if isinstance(entry, str):
            if entry not in modules:
                known = ", ".join(repr(n) for n in list(modules)[1:9])
                raise ConfigError(
                    f"zero3 unit {entry!r} is not a module of the model; give qualified names as "
                    f"model.named_modules() spells them (some of this model's: {known}), or module classes"
                )
            chosen.add(entry)
        elif isinstance(entry, type) and issubclass(entry, nn.Module):
            found = [name for name, m in modules.items() if isinstance(m, entry)]
            if not found:
                raise ConfigError(f"zero3 units name the class {entry.__name__}, but no module of the model is one")
            chosen.update(found)
        else:
            raise ConfigError(
                f"zero3 units are module classes or qualified module names; found {type(entry).__name__} {entry!r}"
            )
    return [name for name in modules if name in chosen and name != ""]


def unit_names(model: nn.Module, units: UnitSpec | None = None, min_params: int = DEFAULT_MIN_PARAMS) -> list[str]:
    """The names of the modules that become units (the root, ``""``, first), in registration order."""
    if min_params < 1:
        raise ConfigError(f"min_params must be at least 1; found {min_params}")
    return ["", *(_default_names(model, min_params) if units is None else _named_units(model, units))]


def _innermost(module_name: str, units: Sequence[str]) -> str:
    """The innermost unit whose subtree holds the module ``module_name``."""
    best = ""
    for unit in units:
        inside = unit == "" or module_name == unit or module_name.startswith(f"{unit}.")
        if inside and len(unit) > len(best):
            best = unit
    return best


def _common(names: Sequence[str]) -> str:
    """The deepest module name that is (or is an ancestor of) every one of ``names``."""
    parts = [n.split(".") if n else [] for n in names]
    shared: list[str] = []
    for level in zip(*parts, strict=False):
        if any(p != level[0] for p in level):
            break
        shared.append(level[0])
    return ".".join(shared)


def plan_units(model: nn.Module, units: UnitSpec | None = None, min_params: int = DEFAULT_MIN_PARAMS) -> list[UnitPlan]:
    """The units of ``model`` (module docstring): the default policy, or the classes and names in ``units``.

    Raises:
        ConfigError: a name that is no module of the model, a class none is, or a unit whose parameters are of
            several dtypes or devices (a unit is one flat buffer).
    """
    names = unit_names(model, units, min_params)
    users: dict[int, list[str]] = {}  # a parameter -> the units of every module that registers it
    for module_name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), []).append(_innermost(module_name, names))
    held: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name in names}
    for param_name, p in model.named_parameters():
        owner = _innermost(_common(users[id(p)]), names)
        held[owner].append((param_name, p))
    modules = dict(model.named_modules())
    plan = []
    for name in names:
        if not held[name]:
            continue
        kinds = {(p.dtype, p.device) for _, p in held[name]}
        if len(kinds) > 1:
            listed = ", ".join(f"{n} {str(p.dtype).removeprefix('torch.')} on {p.device}" for n, p in held[name][:6])
            raise ConfigError(
                f"zero3 unit {name or '(the root)'!r} holds parameters of several dtypes or devices ({listed}): a "
                f"unit is one flat buffer; make those modules units of their own, or convert the model to one dtype"
            )
        plan.append(UnitPlan(name, modules[name], tuple(p for _, p in held[name]), tuple(n for n, _ in held[name])))
    return plan
