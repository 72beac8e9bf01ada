"""Why a parallel run differs from one device: forward order of parameters, and the causes verify recognises.

    order = forward_order(model, x)                # parameter names in the order their modules run
    causes = recognise_causes(model, x, seed, config_devices=2, grads_single, grads_other)

Each recognised cause is a :class:`Cause`: a short name, what was found, and what to do about it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from paratrain.parallel import seed_everything

__all__ = [
    "Cause",
    "batchnorm_cause",
    "dropout_cause",
    "forward_order",
    "gradient_scale",
    "probe_forward",
    "sum_loss_cause",
]


@dataclass(frozen=True)
class Cause:
    name: str  # batchnorm, dropout, randomness, sum-loss, nondeterminism
    found: str
    advice: str

    def render(self) -> str:
        return f"{self.found}; {self.advice}"


def forward_order(model: nn.Module, sample: torch.Tensor) -> list[str]:
    """Parameter names in the order their modules first run in forward (hooks on a copy of ``model``).

    Parameters of modules that never run (or that the hooks cannot see) follow, in registration order; a
    forward that fails on ``sample`` leaves registration order.
    """
    probe = copy.deepcopy(model)
    seen: list[nn.Module] = []

    def note(module: nn.Module, args: object) -> None:
        if not any(module is m for m in seen):
            seen.append(module)

    handles = [m.register_forward_pre_hook(note) for m in probe.modules()]
    try:
        with torch.no_grad():
            probe(sample)
    except Exception:  # the runs themselves will report the model's failure
        seen.clear()
    finally:
        for h in handles:
            h.remove()
    names = {id(m): name for name, m in probe.named_modules()}
    order: list[str] = []
    # a module's own parameters (not its children's) belong to it; a module runs before the children it calls,
    # so a child's parameters are listed when the child's own pre-hook fires
    for module in seen:
        prefix = names[id(module)]
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{pname}" if prefix else pname
            if full not in order:
                order.append(full)
    for full, _ in probe.named_parameters():
        if full not in order:
            order.append(full)
    return order


def batchnorm_cause(model: nn.Module, strategy: str) -> Cause | None:
    """BatchNorm layers in training mode: each replica or rank normalises with its own share's statistics."""
    layers = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if not layers:
        return None
    advice = (
        "convert them with torch.nn.SyncBatchNorm.convert_sync_batchnorm (ddp on GPUs) so statistics cover the "
        "whole batch"
        if strategy in ("ddp", "zero1", "zero2", "zero3")
        else "under ddp on GPUs SyncBatchNorm computes statistics over the whole batch; dp cannot"
    )
    return Cause(
        "batchnorm",
        f"BatchNorm in training mode ({_listed(layers)}) normalises each device's share with that share's own "
        "statistics, not the global batch's",
        f"{advice}; or use GroupNorm/LayerNorm, keep BatchNorm in eval mode (frozen statistics), or accept the "
        "difference (it shrinks as the per-device batch grows)",
    )


def dropout_cause(model: nn.Module) -> Cause | None:
    """Dropout layers in training mode: every device draws its own random mask for its share."""
    layers = [name for name, m in model.named_modules() if isinstance(m, _DropoutNd) and m.training and m.p > 0]
    if not layers:
        return None
    return Cause(
        "dropout",
        f"dropout in training mode ({_listed(layers)}): each device draws its share's mask from its own random "
        "stream, so the masks differ from one device's",
        "this is expected and harmless for training; to compare exactly, verify with dropout off (p=0 or "
        "model.eval() for those layers)",
    )


def probe_forward(model: nn.Module, sample: torch.Tensor, seed: int) -> tuple[bool, bool]:
    """Run forward three times on ``sample``: twice with ``seed``, once with another seed.

    Returns ``(nondeterministic, random)``: outputs differ under the same seed; outputs differ between seeds.
    """
    outputs = []
    for s in (seed, seed, seed + 1):
        replica = copy.deepcopy(model)  # buffers (BatchNorm statistics) start the same each time
        seed_everything(s)
        try:
            with torch.no_grad():
                out = replica(sample)
        except Exception:  # a model that cannot run on the sample: nothing to tell from it
            return False, False
        outputs.append(out.detach() if isinstance(out, torch.Tensor) else None)
    a, b, c = outputs
    if a is None or b is None or c is None:
        return False, False
    nondeterministic = not torch.equal(a, b)
    return nondeterministic, (not nondeterministic and not torch.equal(a, c))


def randomness_causes(model: nn.Module, sample: torch.Tensor, seed: int, known_dropout: bool) -> list[Cause]:
    nondeterministic, random = probe_forward(model, sample, seed)
    causes = []
    if nondeterministic:
        causes.append(
            Cause(
                "nondeterminism",
                "two forward passes on the same input with the same seed gave different outputs: non-deterministic "
                "kernels, or randomness from a generator that torch.manual_seed does not seed",
                "run with torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG=:4096:8 on GPUs), "
                "and draw random numbers from torch's seeded generators",
            )
        )
    elif random and not known_dropout:
        causes.append(
            Cause(
                "randomness",
                "forward draws random numbers (outputs change with the seed, not only through dropout layers): each "
                "device draws its share's numbers from its own random stream",
                "expected for training; to compare exactly, switch the randomness off while verifying",
            )
        )
    return causes


def gradient_scale(
    reference: Sequence[torch.Tensor | None], other: Sequence[torch.Tensor | None]
) -> tuple[float, float]:
    """The factor ``s`` that best fits ``reference ~ s * other`` over all gradients, and the relative residual."""
    pairs = [
        (a.double().flatten(), b.double().flatten())
        for a, b in zip(reference, other, strict=True)
        if a is not None and b is not None
    ]
    if not pairs:
        return 1.0, 0.0
    ref = torch.cat([a for a, _ in pairs])
    oth = torch.cat([b for _, b in pairs])
    denominator = float(oth.dot(oth))
    if denominator == 0.0:
        return 1.0, 0.0
    scale = float(ref.dot(oth)) / denominator
    norm = float(ref.norm())
    residual = float((ref - scale * oth).norm()) / norm if norm else 0.0
    return scale, residual


def sum_loss_cause(
    reference: Sequence[torch.Tensor | None], other: Sequence[torch.Tensor | None], device_count: int, loss: str
) -> Cause | None:
    """Gradients that are the single device's divided by the device count: a loss reduced with ``sum``.

    Under ddp each rank's loss counts as its share of the global batch (the right weight for a mean); a summed
    loss is already the share's total, so the averaged gradient comes out ``device_count`` times too small.
    """
    if device_count < 2:
        return None
    scale, residual = gradient_scale(reference, other)
    if abs(scale - device_count) > 0.1 * device_count or residual > 0.1:
        return None
    flag = " (--loss sum)" if loss == "sum" else ""
    return Cause(
        "sum-loss",
        f"the first step's gradients are {scale:.2f} times smaller than one device's (residual {residual:.1%}), "
        f"close to the {device_count} devices: a loss reduced with sum{flag} instead of mean scales with each "
        "device's share",
        "reduce the loss with mean (F.cross_entropy's default), or divide the summed loss by the global batch size",
    )


def _listed(names: Sequence[str], limit: int = 4) -> str:
    shown = [n or "<model>" for n in names[:limit]]
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")
