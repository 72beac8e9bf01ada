"""Models under ``torch.compile``: the module inside torch's compiled wrapper, found by type, never by name.

    inner = compiled_inner(model)        # torch.compile(m)'s wrapper -> m; any other module -> None
    plain = without_compiled(model)      # the module itself, or the one inside its compiled wrapper

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model as ``_orig_mod`` (its state dict keys
carry that prefix); ``model.compile()`` compiles in place and leaves the module's type and keys as they are. A
strategy takes either, before or after ``prepare``: what it wrapped is found through the compiled wrapper.
"""

from __future__ import annotations

from torch import nn

__all__ = ["ORIG_PREFIX", "compiled_inner", "without_compiled"]

ORIG_PREFIX = "_orig_mod."  # what torch.compile's wrapper puts before every key of the module's state dict


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo: nothing is ever compiled
        return None
    return OptimizedModule


def compiled_inner(module: object) -> nn.Module | None:
    """The module inside ``torch.compile``'s wrapper ``module``; None for anything else."""
    kind = _optimized_module_type()
    if kind is not None and isinstance(module, kind):
        inner = getattr(module, "_orig_mod", None)
        return inner if isinstance(inner, nn.Module) else None
    return None


def without_compiled(module: nn.Module) -> nn.Module:
    """``module``, or the module inside its compiled wrapper (nested wrappers unwrapped too)."""
    inner = compiled_inner(module)
    while inner is not None:
        module, inner = inner, compiled_inner(inner)
    return module
