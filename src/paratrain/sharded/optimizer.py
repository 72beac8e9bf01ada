"""The user's optimizer over this rank's shard: the same class, every group's settings, this rank's state only.

    sharded = shard_optimizer(optimizer, source)    # source: the zero1 / zero2 wrapper of the model
    isinstance(sharded, type(optimizer))            # True: an instance of a subclass of the user's class
    sharded.param_groups[1]["weight_decay"]         # every group's settings, kept; schedulers built on it work
    sharded.state                                   # this rank's pieces of the parameters, nothing else
    sharded.step()                                  # update this rank's pieces, then all-gather the weights

Each parameter group holds this rank's pieces of the group's parameters (:class:`OwnedPiece`: 1-d views of the
weights' flat buffers, so an update in place is an update of the model), which may be none. A step runs the
user's class's own update bucket by bucket, starting each bucket's all-gather of the updated weights as soon as
its pieces are updated (so the gathers overlap the later buckets' updates), and returns once they are done:
whatever reads the weights after ``step()`` reads the updated ones (on NCCL the stream waits, the host goes on). The
update of one element must depend only on that element's gradient and state, which holds for the classes in
:data:`ELEMENTWISE`; others are refused by name (a class of the user's own may declare
``paratrain_elementwise = True``).

State dicts: :meth:`ShardedOptimizer.state_dict` is this rank's, for this layout only;
:meth:`ShardedOptimizer.sharded_state_dict` is the checkpoint's canonical form (torch's format, indexed as the
user's optimizer indexes its parameters, each per-element tensor as this rank's slices of the whole); and
:meth:`ShardedOptimizer.load_state_dict` takes either, or a whole optimizer's state dict from any strategy
(tensors whole, or read lazily slice by slice from a sharded checkpoint).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.sharded import LocalSlices, Owned, StoredTensor
from paratrain.errors import ConfigError

__all__ = [
    "ELEMENTWISE",
    "OwnedPiece",
    "ShardSource",
    "ShardedOptimizer",
    "agree_found_inf",
    "check_elementwise",
    "shard_optimizer",
]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
# why each of torch's others cannot update a piece of a parameter on its own
_NOT_ELEMENTWISE = {
    "LBFGS": "its step evaluates the loss again and searches along a direction built from every parameter at once",
    "SparseAdam": "it takes sparse gradients, which the sharded strategies do not reduce",
    "Adafactor": "it factors each parameter's second moment over its rows and columns: it needs the whole matrix",
    "Muon": "it orthogonalises each parameter's update as a whole matrix",
}
_MARKER = "paratrain_shard"  # the key a rank's own state_dict carries: whose pieces, of which layout


@dataclass(frozen=True)
class OwnedPiece:
    """This rank's share of one model parameter: elements ``[start, start + length)`` of it, flattened."""

    param: nn.Parameter  # the model's parameter
    bucket: int
    start: int
    value: torch.Tensor  # (length,): a view of the parameter's storage

    @property
    def length(self) -> int:
        return self.value.numel()


class ShardSource(Protocol):
    """What a sharded optimizer needs from the model's wrapper (:class:`paratrain.sharded.zero.ZeroDataParallel`)."""

    rank: int
    world_size: int

    @property
    def bucket_count(self) -> int: ...

    def owned_pieces(self) -> list[OwnedPiece]: ...

    def trains(self, param: torch.Tensor) -> bool: ...

    def piece_grad(self, piece: OwnedPiece) -> torch.Tensor | None: ...

    def launch_gather(self, bucket: int) -> None: ...

    def gathers_launched(self) -> None: ...

    def gathers_failed(self) -> None: ...

    def zero_grad(self, set_to_none: bool) -> None: ...

    def agree_found_inf(self, found: dict[torch.device, torch.Tensor]) -> None: ...

    def grads_unscaled(self, params: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> None: ...

    def on_synchronised(self, callback: Callable[[], None]) -> None: ...


def agree_found_inf(
    found: dict[torch.device, torch.Tensor], device: torch.device, control: torch.device, group: Any, monitor: Any
) -> None:
    """The gradient scaler's per-device inf/nan flags made the maximum over every rank, in place (a shard source's
    :meth:`ShardSource.agree_found_inf`). A rank whose pieces had no gradient takes part with nothing found, on
    ``device``; ``control`` is where the collective runs."""
    if not found:
        found[device] = torch.zeros(1, dtype=torch.float32, device=device)
    for flag in found.values():
        mine = flag.to(control)
        seq = monitor.launched()
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True)
        monitor.wait(work, seq, "inf/nan check of the scaled gradients")
        flag.copy_(mine)


def _raw(function: Any) -> Any:
    return inspect.unwrap(function)


def check_elementwise(cls: type[torch.optim.Optimizer]) -> None:
    """Raise ConfigError unless ``cls`` updates each element from that element's gradient and state alone."""
    if getattr(cls, "paratrain_elementwise", False) is True:
        return
    for known in ELEMENTWISE:
        # a subclass that keeps the known class's update is as elementwise as it
        if issubclass(cls, known) and _raw(cls.step) is _raw(known.step):
            return
    name = cls.__name__
    why = next((reason for other, reason in _NOT_ELEMENTWISE.items() if other == name), None)
    found = f"{name}: {why}" if why else f"{name}, which paratrain does not know to update element by element"
    raise ConfigError(
        f"the sharded strategies (zero1, zero2) split every parameter across ranks and update each rank's piece "
        f"on its own, so the optimizer's update of an element must depend on that element's gradient and state "
        f"only; found {found}. Use one of {', '.join(c.__name__ for c in ELEMENTWISE)}, or strategy ddp; a "
        f"class of your own whose update is elementwise can say so with the class attribute "
        f"paratrain_elementwise = True"
    )


class ShardedOptimizer(torch.optim.Optimizer):
    """Placed before the user's optimizer class: the same update, over this rank's pieces (module docstring)."""

    _shard: _Shard

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._shard.step(self, kwargs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._shard.source.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_shard", None) is not None:
            raise ConfigError(
                "a sharded optimizer's parameters are fixed when par.prepare() builds it: give every parameter "
                "group to the optimizer before preparing it"
            )
        super().add_param_group(param_group)

    def agree_found_inf(self, found: dict[torch.device, torch.Tensor]) -> None:
        """Make the gradient scaler's inf/nan check global: a step skips on every rank or on none."""
        self._shard.source.agree_found_inf(found)

    def gradients_unscaled(self, inv_scale: torch.Tensor) -> None:
        """The gradient scaler multiplied this rank's pieces' gradients by ``inv_scale``: the wrapper does the same to
        what it holds of this optimizer's parameters beyond them (the norm a clip measures is then ddp's)."""
        self._shard.source.grads_unscaled(self._shard.params, inv_scale)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as torch's state dict of its pieces; it loads back only into the same layout."""
        own = super().state_dict()
        own[_MARKER] = self._shard.marker()
        return own

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's own :meth:`state_dict`, or a whole optimizer's (any strategy's), slicing out the pieces.

        Raises:
            ValueError: a state dict of another layout, or one that does not fit the parameter groups.
        """
        marker = state_dict.get(_MARKER)
        if marker is not None:
            if marker != self._shard.marker():
                raise ValueError(
                    f"this state dict is one rank's pieces of another layout ({marker}), not this one's "
                    f"({self._shard.marker()}); load a whole optimizer's state (sharded_state_dict() in a checkpoint "
                    f"written by Parallel.save) to change the number of ranks"
                )
            super().load_state_dict({k: v for k, v in state_dict.items() if k != _MARKER})
            return
        super().load_state_dict(self._shard.pieces_state(self, state_dict))

    def sharded_state_dict(self) -> dict[str, Any]:
        """The canonical state: torch's format over the user's parameters, this rank's slices of each tensor."""
        return self._shard.canonical(self)


def sharded_class(base: type[torch.optim.Optimizer]) -> type[ShardedOptimizer]:
    """A subclass of ``base`` whose instances :func:`shard_optimizer` returns: ``base``'s update, sharded."""
    return type(base.__name__, (ShardedOptimizer, base), {"__module__": __name__, "__doc__": base.__doc__})


def shard_optimizer(
    optimizer: torch.optim.Optimizer, source: ShardSource, *, in_place: bool = False
) -> ShardedOptimizer:
    """An optimizer of ``optimizer``'s class over this rank's pieces of its parameters (module docstring).

    State the optimizer already holds (loaded before ``prepare``) is sliced into the pieces. ``in_place``: the
    user's optimizer object itself becomes the sharded one and is returned (what ``par.prepare`` does), so that
    whatever holds it (a learning-rate scheduler built before ``prepare``, the user's own name for it) drives
    the optimizer that steps.

    Raises:
        ConfigError: a class whose update is not elementwise, or a parameter that ``source`` does not hold.
    """
    check_elementwise(type(optimizer))
    pieces = source.owned_pieces()
    by_param: dict[int, list[OwnedPiece]] = {}
    for piece in pieces:
        by_param.setdefault(id(piece.param), []).append(piece)
    groups, members, order = [], [], []
    index = itertools.count()
    for group in optimizer.param_groups:
        mine, indices = [], []
        for p in group["params"]:
            i = next(index)
            indices.append(i)
            order.append((i, p))
            mine += by_param.get(id(p), [])
        members.append(indices)
        groups.append((group, mine))
    # a frozen parameter is in no bucket and never gets a gradient to step on: it has no piece, and needs none
    foreign = [p for _, p in order if not source.trains(p) and p.requires_grad]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:4])
        raise ConfigError(
            f"the optimizer holds {len(foreign)} parameter(s) ({shapes}) that the model prepared under this "
            f"sharded strategy does not train: prepare the model first (par.prepare(model, optimizer)), and build "
            f"the optimizer over that model's parameters"
        )
    values = {id(piece): nn.Parameter(piece.value) for piece in pieces}  # aliases: updates land in the weights
    built = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [values[id(piece)] for piece in mine]}
        for group, mine in groups
    ]
    placeholder = None
    if not any(g["params"] for g in built):  # this rank owns no element at all (a tiny model on many ranks)
        placeholder = nn.Parameter(torch.empty(0, device=source_device(pieces, optimizer)))
        built[0]["params"] = [placeholder]
    cls = sharded_class(type(optimizer))
    try:
        sharded = cls(built, **_constructor_arguments(type(optimizer), optimizer.defaults))
    except TypeError as exc:
        raise ConfigError(
            f"{type(optimizer).__name__}(params, **defaults) failed ({exc}): the sharded strategies rebuild the "
            f"optimizer over this rank's pieces from its defaults, so its constructor must take them as keywords"
        ) from exc
    sharded.defaults = dict(optimizer.defaults)  # all of them, also those its constructor derives (AdamW's)
    sharded._shard = _Shard(type(optimizer), source, pieces, [values[id(p)] for p in pieces], members, order)
    sharded._shard.placeholder = placeholder
    if optimizer.state:
        sharded.load_state_dict(optimizer.state_dict())
    if in_place:
        sharded = _become(optimizer, sharded)
    source.on_synchronised(_assigner(sharded))
    return sharded


# what the user's optimizer keeps when it becomes the sharded one: its hooks, registered before prepare
_KEPT = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
         "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
         "_optimizer_load_state_dict_post_hooks")  # fmt: skip


def _become(optimizer: torch.optim.Optimizer, sharded: ShardedOptimizer) -> ShardedOptimizer:
    """``optimizer`` (the user's object) made ``sharded``: its class, groups, state and pieces; ``optimizer``."""
    own = optimizer.__dict__
    scheduled = getattr(own.get("step"), "_wrapped_by_lr_sched", False)  # a scheduler built before prepare
    kept = {name: own[name] for name in _KEPT if name in own}
    own.clear()
    own.update(sharded.__dict__)
    own.update(kept)
    optimizer.__class__ = type(sharded)
    became: ShardedOptimizer = optimizer  # type: ignore[assignment]
    if scheduled:
        # the scheduler wrapped the user's class's step on the instance (to warn when it steps first): the same
        # wrapper, around the sharded step
        def step(*args: Any, **kwargs: Any) -> Any:
            became._opt_called = True  # type: ignore[attr-defined]
            return type(became).step(became, *args, **kwargs)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        became.step = step  # type: ignore[method-assign]
    return became


def _constructor_arguments(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults that ``cls``'s constructor takes as keywords (every group carries all of them anyway)."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in parameters}


def source_device(pieces: Sequence[OwnedPiece], optimizer: torch.optim.Optimizer) -> torch.device:
    if pieces:
        return pieces[0].value.device
    first: torch.Tensor = optimizer.param_groups[0]["params"][0]
    return first.device


def _assigner(sharded: ShardedOptimizer) -> Callable[[], None]:
    ref = weakref.ref(sharded)

    def assign() -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._shard.assign_grads()

    return assign


class _Shard:
    """What a sharded optimizer knows of its pieces: where each lives, whose it is, and its bucket."""

    def __init__(
        self,
        base: type[torch.optim.Optimizer],
        source: ShardSource,
        pieces: list[OwnedPiece],
        values: list[nn.Parameter],
        members: list[list[int]],
        order: list[tuple[int, torch.Tensor]],
    ) -> None:
        self.base = base  # the user's class, whose update runs on the pieces
        self.source = source
        self.pieces = pieces
        self.values = values
        self.members = members  # the user's parameter indices of each group, in order
        self.params = [p for _, p in order]  # the user's parameters by index
        self.index_of = {id(p): i for i, p in order}
        self.placeholder: nn.Parameter | None = None  # this rank's stand-in parameter when it owns no element
        group_of = {id(self.params[i]): g for g, indices in enumerate(members) for i in indices}
        # the pieces of each bucket in each group: a step updates them bucket by bucket
        self.by_bucket: list[list[list[nn.Parameter]]] = [[[] for _ in members] for _ in range(source.bucket_count)]
        for piece, value in zip(pieces, values, strict=True):
            if id(piece.param) in group_of:
                self.by_bucket[piece.bucket][group_of[id(piece.param)]].append(value)

    def marker(self) -> str:
        layout = [(self.index_of.get(id(p.param), -1), p.start, p.length) for p in self.pieces]
        digest = hashlib.sha256(repr(layout).encode()).hexdigest()[:16]
        return f"rank {self.source.rank} of {self.source.world_size}, pieces {digest}"

    def assign_grads(self) -> None:
        for piece, value in zip(self.pieces, self.values, strict=True):
            value.grad = self.source.piece_grad(piece)

    def step(self, optimizer: ShardedOptimizer, kwargs: dict[str, Any]) -> None:
        self.assign_grads()
        update = _unhooked(self.base.step)
        groups = optimizer.param_groups
        kept = [g["params"] for g in groups]
        try:
            # the last bucket first: buckets hold the parameters in reverse order, and the next forward needs the
            # first layers' weights first
            for b in reversed(range(len(self.by_bucket))):
                lists = self.by_bucket[b]
                if any(lists):
                    for group, params in zip(groups, lists, strict=True):
                        group["params"] = params
                    update(optimizer, **kwargs)
                self.source.launch_gather(b)  # every rank gathers every bucket, in the same order
        except BaseException:
            self.source.gathers_failed()
            raise
        finally:
            for group, params in zip(groups, kept, strict=True):
                group["params"] = params
        self.source.gathers_launched()

    def canonical(self, optimizer: ShardedOptimizer) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        for piece, value in zip(self.pieces, self.values, strict=True):
            held = optimizer.state.get(value)
            i = self.index_of.get(id(piece.param))
            if not held or i is None:
                continue
            entry = state.setdefault(i, {})
            shape = tuple(piece.param.shape)
            for key, v in held.items():
                if isinstance(v, torch.Tensor) and v.shape == value.shape:
                    entry[key] = LocalSlices(shape, v.dtype, [(piece.start, v)])
                elif piece.start == 0:  # the rest once, from the piece that holds the parameter's first element
                    entry[key] = Owned(v)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(indices)}
            for group, indices in zip(optimizer.param_groups, self.members, strict=True)
        ]
        return {"state": state, "param_groups": groups}

    def pieces_state(self, optimizer: ShardedOptimizer, whole: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer's state dict as torch's state dict of this rank's pieces."""
        saved_groups = whole.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.members):
            count = len(saved_groups) if isinstance(saved_groups, list) else "no"
            raise ValueError(
                f"the saved optimizer has {count} parameter groups and this one {len(self.members)}: build the "
                f"optimizer with the same groups as the run that saved it"
            )
        saved_index: dict[int, Any] = {}
        for g, (saved, mine) in enumerate(zip(saved_groups, self.members, strict=True)):
            if len(saved["params"]) != len(mine):
                raise ValueError(
                    f"parameter group {g} held {len(saved['params'])} parameters when saved and holds {len(mine)} "
                    f"now: build the optimizer over the same parameters as the run that saved it"
                )
            saved_index.update(zip(mine, saved["params"], strict=True))
        numbering = {id(p): n for n, p in enumerate(itertools.chain.from_iterable(self._inner_lists(optimizer)))}
        saved_state = whole.get("state", {})
        state: dict[int, dict[str, Any]] = {}
        for piece, value in zip(self.pieces, self.values, strict=True):
            i = self.index_of.get(id(piece.param))
            entry = saved_state.get(saved_index[i]) if i is not None else None
            if not entry:
                continue
            state[numbering[id(value)]] = {
                key: _slice_of(v, piece, f"state {key!r} of parameter {i}") for key, v in entry.items()
            }
        groups = [
            {**{k: v for k, v in saved.items() if k != "params"}, "params": [numbering[id(p)] for p in params]}
            for saved, params in zip(saved_groups, self._inner_lists(optimizer), strict=True)
        ]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _inner_lists(optimizer: ShardedOptimizer) -> Iterable[list[torch.Tensor]]:
        return [group["params"] for group in optimizer.param_groups]


def _unhooked(step: Any) -> Any:
    """``step`` without the hook wrapper torch's Optimizer puts around a class's step (its pre/post hooks run
    once, around the whole sharded step, not once per bucket).

    HACK: torch marks that wrapper ``hooked`` and builds it with functools.wraps; tests/test_sharded_optimizer.py
    checks that hooks still run exactly once per step.
    """
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _slice_of(value: Any, piece: OwnedPiece, what: str) -> Any:
    """This piece's part of a saved per-element state tensor (whole, or read lazily); other values as they are."""
    shape = tuple(piece.param.shape)
    if isinstance(value, StoredTensor):
        if value.shape == shape:
            return value.read(piece.start, piece.length)  # only the slices that hold this piece are read
        value = value.full()
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) == shape:
            return value.reshape(-1).narrow(0, piece.start, piece.length).clone()
        if value.numel() == 1:
            return value.clone()
        raise ValueError(
            f"saved {what} has shape {tuple(value.shape)}, neither the parameter's {shape} nor a single value: "
            f"the optimizer that saved it was not elementwise, or the model differs"
        )
    return value
