"""Flatten nested batches into leaves and build them back.

A batch is a tree: tuples, lists, dicts (``OrderedDict``, ``defaultdict`` and other subclasses), namedtuples
and dataclasses nest; anything else is a leaf (tensors, numbers, strings, ``None``, ``torch.Size``, ...).
Scatter and gather work leaf by leaf and rebuild the same structure with :func:`unflatten`.

    leaves, spec = flatten({"x": x, "meta": ("a", 3)})   # leaves == [x, "a", 3]
    unflatten([y, "a", 3], spec)                         # {"x": y, "meta": ("a", 3)}

The functions recurse at module level (no closures), so a flatten leaves no reference cycles behind.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TreeSpec", "flatten", "leaf_paths", "map_tensors", "unflatten"]

_LEAF = "leaf"
_TUPLE = "tuple"
_LIST = "list"
_DICT = "dict"
_NAMEDTUPLE = "namedtuple"
_DATACLASS = "dataclass"


@dataclass(frozen=True)
class TreeSpec:
    """The structure of a nested batch, without its leaves; equal specs mean equal structures."""

    kind: str
    node_type: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[TreeSpec, ...] = ()
    # defaultdict's default_factory; dataclass fields that __init__ does not take
    context: Any = None

    @property
    def num_leaves(self) -> int:
        if self.kind == _LEAF:
            return 1
        return sum(child.num_leaves for child in self.children)

    def describe(self) -> str:
        """A short human description, used in error messages."""
        if self.kind == _LEAF:
            return "a leaf"
        name = self.node_type.__name__ if self.node_type is not None else self.kind
        if self.kind in (_DICT, _DATACLASS, _NAMEDTUPLE):
            return f"{name} with keys {list(self.keys)}"
        return f"{name} of length {len(self.children)}"


LEAF = TreeSpec(_LEAF)


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def flatten(obj: Any) -> tuple[list[Any], TreeSpec]:
    """Split ``obj`` into its leaves (depth first, in key order) and its structure."""
    leaves: list[Any] = []
    spec = _flatten_into(obj, leaves)
    return leaves, spec


def _flatten_into(obj: Any, leaves: list[Any]) -> TreeSpec:
    kind, keys, values, context = _node_of(obj)
    if kind == _LEAF:
        leaves.append(obj)
        return LEAF
    children = tuple(_flatten_into(value, leaves) for value in values)
    return TreeSpec(kind, type(obj), keys, children, context)


def _node_of(obj: Any) -> tuple[str, tuple[Any, ...], Sequence[Any], Any]:
    """Classify one node: (kind, keys, child values, context)."""
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        context = obj.default_factory if isinstance(obj, defaultdict) else None
        return _DICT, keys, [obj[k] for k in keys], context
    if type(obj) is tuple:
        return _TUPLE, (), obj, None
    if type(obj) is list:
        return _LIST, (), obj, None
    if _is_namedtuple(obj):
        return _NAMEDTUPLE, tuple(type(obj)._fields), obj, None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        no_init = tuple(f.name for f in fields if not f.init)
        names = tuple(f.name for f in fields)
        return _DATACLASS, names, [getattr(obj, n) for n in names], no_init
    return _LEAF, (), (), None


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    """Rebuild the structure ``spec`` around ``leaves`` (the inverse of :func:`flatten`)."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"the structure holds {spec.num_leaves} leaves but {len(leaves)} were given")
    it = iter(leaves)
    return _build(it, spec)


def _build(it: Iterator[Any], spec: TreeSpec) -> Any:
    if spec.kind == _LEAF:
        return next(it)
    values = [_build(it, child) for child in spec.children]
    cls: Any = spec.node_type
    if spec.kind == _TUPLE:
        return tuple(values)
    if spec.kind == _LIST:
        return values
    if spec.kind == _NAMEDTUPLE:
        return cls(*values)
    if spec.kind == _DICT:
        pairs = list(zip(spec.keys, values, strict=True))
        if issubclass(cls, defaultdict):
            return cls(spec.context, pairs)
        return cls(pairs)
    # dataclass: construct with the __init__ fields, then set the others as dataclasses.replace would not
    no_init = spec.context or ()
    init_kwargs = {k: v for k, v in zip(spec.keys, values, strict=True) if k not in no_init}
    obj = cls(**init_kwargs)
    for k, v in zip(spec.keys, values, strict=True):
        if k in no_init:
            object.__setattr__(obj, k, v)
    return obj


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """The same structure with ``fn`` applied to every tensor leaf (other leaves unchanged)."""
    leaves, spec = flatten(obj)
    return unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def leaf_paths(spec: TreeSpec, root: str = "") -> list[str]:
    """A readable path for each leaf, in flatten order, such as ``[0]['mask']`` or ``.logits``."""
    paths: list[str] = []
    _paths_into(spec, root, paths)
    return paths


def _paths_into(spec: TreeSpec, prefix: str, paths: list[str]) -> None:
    if spec.kind == _LEAF:
        paths.append(prefix or "<root>")
        return
    for i, child in enumerate(spec.children):
        if spec.kind in (_TUPLE, _LIST):
            step = f"[{i}]"
        elif spec.kind == _DICT:
            step = f"[{spec.keys[i]!r}]"
        else:
            step = f".{spec.keys[i]}"
        _paths_into(child, prefix + step, paths)
