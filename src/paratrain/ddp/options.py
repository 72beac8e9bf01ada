"""DDP's options as one value: what ``Parallel("ddp", find_unused_parameters=True)`` hands its strategy.

    options = DDPOptions(find_unused_parameters=True, bucket_cap_mb=50)
    strategy = DistributedStrategy("cpu", options=options)          # or Parallel("ddp", find_unused_parameters=True)
    options.given()                                                   # ['find_unused_parameters', 'bucket_cap_mb']

The defaults are the strategy's own (``gradient_as_bucket_view=True``: the buckets are the gradients, one copy of
them). Each strategy either honours an option or refuses it by name when it is built (:func:`refuse_options`);
docs/ddp.md has the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from paratrain.ddp.comm_hooks import CommHook
from paratrain.errors import ConfigError

__all__ = ["DDPOptions", "Refusal", "refuse_options"]


@dataclass(frozen=True)
class DDPOptions:
    """How a ddp (or zero1/zero2/zero3) strategy builds its wrapper; each as in :class:`DistributedDataParallel`.

    Args:
        find_unused_parameters: parameters that get no gradient in a step take part with zeros.
        static_graph: the same parameters take part in every iteration, each as often.
        bucket_cap_mb: the largest gradient bucket, in MiB (``None``: the wrapper's default, 25).
        gradient_as_bucket_view: ``.grad`` are views into the buckets (the default: one copy of the gradients).
        comm_hook: ``hook(state, bucket) -> Future[Tensor]``, registered on every model the strategy wraps
            (``register_comm_hook(comm_state, comm_hook)``).
        comm_state: the hook's state (``None``: the hooks of :mod:`paratrain.ddp.comm_hooks` and torch's take the
            default group).

    Raises:
        ConfigError: a value of the wrong type, a bucket size that is not a positive number, or ``comm_state``
            without ``comm_hook``.
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    comm_hook: CommHook | None = None
    comm_state: Any = None

    def __post_init__(self) -> None:
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} takes True or False; found {value!r} ({type(value).__name__})")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap)):
            raise ConfigError(f"bucket_cap_mb takes a number of MiB (or None: 25); found {cap!r}")
        if cap is not None and cap <= 0:
            raise ConfigError(f"bucket_cap_mb is the largest gradient bucket in MiB and must be positive; found {cap}")
        if self.comm_hook is not None and not callable(self.comm_hook):
            found = type(self.comm_hook).__name__
            raise ConfigError(f"comm_hook must be callable as hook(state, bucket); found {found}")
        if self.comm_hook is None and self.comm_state is not None:
            raise ConfigError(
                f"comm_state is the state of comm_hook, and no comm_hook was given (comm_state="
                f"{type(self.comm_state).__name__}): pass comm_hook too, or drop comm_state"
            )

    def given(self) -> list[str]:
        """The options set to something other than their default, in declaration order."""
        return [f.name for f in fields(self) if _differs(getattr(self, f.name), f.default)]

    def shown(self, name: str) -> str:
        """``find_unused_parameters=True``: an option as a user wrote it (a hook by its name)."""
        value = getattr(self, name)
        if name == "comm_hook":
            return f"comm_hook={getattr(value, '__name__', type(value).__name__)}"
        if name == "comm_state":
            return f"comm_state={type(value).__name__}"
        return f"{name}={value!r}"


def _differs(value: Any, default: Any) -> bool:
    """A flag or size by value (``bucket_cap_mb=25.0`` differs from None); a hook or its state by identity."""
    if default is None:
        return value is not None
    return bool(value != default)


@dataclass(frozen=True)
class Refusal:
    """Why a strategy cannot honour an option, and what to do instead (the two halves of its ConfigError)."""

    why: str
    fix: str


def refuse_options(strategy: str, options: DDPOptions, refused: dict[str, Refusal]) -> None:
    """Raise for the first option ``options`` sets that ``strategy`` refuses (``refused``: by option name).

    Raises:
        ConfigError: naming the option, the strategy, why, and what to do.
    """
    for name in options.given():
        refusal = refused.get(name)
        if refusal is not None:
            raise ConfigError(f"{options.shown(name)} is not supported under {strategy}: {refusal.why}; {refusal.fix}")
