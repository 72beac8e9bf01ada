"""``paratrain verify``: does every parallel configuration train exactly like one device?

    paratrain verify                                          # every configuration this machine can run
    paratrain verify --model mypkg.nets:make_net --input-shape 3,32,32 --configs single dp:cpu,cpu ddp:2
    paratrain verify --loss sum --configs single ddp:2        # see what a summed loss does under ddp
    paratrain verify --configs single ddp:2 zero1:2 zero2:3   # the sharded strategies against one device

Every configuration starts from the same weights (built once here, saved, loaded by each) and trains on the same
global batches for ``--steps`` optimizer steps. Per step it records the global batch's loss, every parameter's
synchronised gradient (after backward, before the step) and the parameters after the step; each is compared
with ``single``'s. A configuration that differs beyond the tolerance is named with the first parameter that
diverges in forward order and the causes recognised. What this machine cannot run is reported as skipped.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..parallel import Parallel, seed_everything
from ..settings import at_least, optional, setting
from .configs import RunConfig, parse_configs, unavailable_reason
from .diagnose import (
    Cause,
    batchnorm_cause,
    dropout_cause,
    forward_order,
    randomness_causes,
    sum_loss_cause,
)
from .report import format_table, write_json
from .runner import ConfigRunError, run_config
from .settings import RunSettings, settings_from
from .workload import Workload, build_optimizer, endless

__all__ = ["ConfigVerdict", "VerifyConfig", "VerifyReport", "default_tolerance", "verify"]

PASS, FAIL, SKIPPED, ERROR = "PASS", "FAIL", "SKIPPED", "ERROR"

# Default (rtol, atol) by parameter dtype. A tensor passes when max|a - b| <= atol + rtol * max|b|: the
# rounding a different split adds comes from summing partial results in another order, so it scales with the
# magnitude of the tensor's terms, not with each element (an element near zero is the sum of larger terms that
# cancel; an element-wise rtol would fail it for rounding alone). float32 keeps ~7 digits; sums over a batch
# and a few steps of SGD lose one or two, measured here at up to ~2e-6 relative, so 1e-5 leaves a 5x margin
# while a real difference (a share's BatchNorm statistics, a loss off by the device count) is 1e-3 or more.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-7),
    torch.bfloat16: (2e-2, 1e-4),
    torch.float16: (2e-3, 1e-5),
}


_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for parameters of ``dtype``."""
    return _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])


@dataclass
class VerifyConfig(RunSettings):
    """Settings of ``paratrain verify``."""

    rtol: float | None = setting(
        None, "relative tolerance, of each tensor's largest value (default: by dtype)", check=optional(at_least(0))
    )
    atol: float | None = setting(None, "absolute tolerance (default: by dtype)", check=optional(at_least(0)))


@dataclass
class ConfigVerdict:
    """One configuration against single: the largest differences, the verdict and, when it fails, why."""

    config: str
    status: str  # PASS, FAIL, SKIPPED, ERROR
    reason: str = ""  # why skipped or failed to run
    devices: int = 1
    max_abs: dict[str, float] = field(default_factory=dict)  # loss, gradient, parameter
    max_rel: dict[str, float] = field(default_factory=dict)
    first_divergence: dict[str, Any] | None = None  # step, parameter, quantity, abs, rel
    causes: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class VerifyReport:
    """What ``verify`` found; :attr:`ok` is False when a configuration failed or could not run."""

    settings: dict[str, Any]
    rtol: float
    atol: float
    verdicts: list[ConfigVerdict]
    forward_order: list[str]
    written: list[str] = field(default_factory=list)  # the files written (the JSON report)

    @property
    def ok(self) -> bool:
        return all(v.status in (PASS, SKIPPED) for v in self.verdicts)

    def verdict(self, config: str) -> ConfigVerdict:
        return next(v for v in self.verdicts if v.config == config)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": "verify",
            "ok": self.ok,
            "settings": self.settings,
            "tolerance": {"rtol": self.rtol, "atol": self.atol, "rule": "max|a-b| <= atol + rtol * max|single|"},
            "forward_order": self.forward_order,
            "configs": [asdict(v) for v in self.verdicts],
        }

    def render(self) -> str:
        rows = []
        for v in self.verdicts:
            if v.status in (SKIPPED, ERROR):
                rows.append([v.config, "-", "-", "-", f"{v.status}: {v.reason}"])
                continue
            rows.append(
                [v.config]
                + [f"{v.max_abs[q]:.2e} / {v.max_rel[q]:.2e}" for q in ("loss", "gradient", "parameter")]
                + [v.status]
            )
        lines = [
            format_table(["configuration", "loss abs/rel", "gradients abs/rel", "parameters abs/rel", "verdict"], rows),
            f"tolerance: max|diff| <= {self.atol:g} + {self.rtol:g} x max|single| per tensor; "
            f"{self.settings['steps']} steps, global batch {self.settings['batch_size']}",
        ]
        for v in self.verdicts:
            if v.status != FAIL:
                continue
            lines.append("")
            d = v.first_divergence
            if d is not None:
                lines.append(
                    f"{v.config}: first divergence at step {d['step']}: {d['quantity']} of {d['parameter']!r} "
                    f"(forward order #{d['position']}), max abs {d['abs']:.3e}, rel {d['rel']:.3e}"
                )
            else:
                lines.append(f"{v.config}: the loss diverges before any parameter does")
            if v.causes:
                for c in v.causes:
                    lines.append(f"  likely cause ({c['name']}): {c['found']}")
                    lines.append(f"    what to do: {c['advice']}")
            else:
                lines.append("  no recognised cause (BatchNorm, dropout or randomness, summed loss, non-determinism)")
        return "\n".join(lines)


# -- one configuration's run (here, or in each ddp rank) ---------------------------------------------------------


def run_in(par: Parallel, settings: VerifyConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """Train ``settings.steps`` steps under ``par``; record losses, gradients and parameters per step (CPU)."""
    work = Workload.load(settings)
    model = work.build_model()
    model.load_state_dict(torch.load(extra["initial_state"], weights_only=True))
    optimizer = build_optimizer(settings, model.parameters())
    model, optimizer, loader = par.prepare(model, optimizer, work.loader())
    inner = par.unwrap(model)
    params = list(inner.parameters())
    seed_everything(settings.seed)  # every configuration's random stream starts alike (dropout)
    batches = endless(loader)
    losses, grads, after = [], [], []
    mean = settings.loss == "mean"
    for _ in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=par.device)
        for inputs, targets in par.accumulate(model, next(batches), steps=settings.accumulate):
            loss = work.loss(model(inputs), targets)
            par.backward(loss)
            if len(targets):  # a mean over no samples is NaN; it adds nothing to the global batch's loss
                total += loss.detach().double() * (len(targets) if mean else 1)
        share = loader.share
        # the global batch's loss: a mean weighs each piece by its samples; a sum adds the pieces' sums
        global_loss = par.all_reduce(total, "sum") / (share.total if mean and share.total else 1)
        losses.append(float(global_loss))
        if settings.clip_grad_norm is not None:
            par.clip_grad_norm_(model, settings.clip_grad_norm)
        # whole, also where no process holds a whole gradient (zero2 gathers its shards)
        grads.append([None if g is None else g.detach().to("cpu", copy=True) for g in par.gradients(model)])
        par.step(optimizer)
        after.append([p.detach().to("cpu", copy=True) for p in params])
    return {"names": [n for n, _ in inner.named_parameters()], "losses": losses, "grads": grads, "params": after}


# -- comparing against single --------------------------------------------------------------------------------------


def _difference(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float, float]:
    """(max abs difference, that relative to max|b|, max|b|); a missing gradient on one side only is infinite."""
    if a is None or b is None:
        return (0.0, 0.0, 0.0) if a is None and b is None else (float("inf"), float("inf"), 0.0)
    if a.shape != b.shape:
        return float("inf"), float("inf"), 0.0
    diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    scale = float(b.double().abs().max()) if b.numel() else 0.0
    return diff, diff / scale if scale else (0.0 if diff == 0 else float("inf")), scale


def compare(
    reference: dict[str, Any], other: dict[str, Any], order: list[str], rtol: float, atol: float
) -> tuple[dict[str, float], dict[str, float], dict[str, Any] | None, bool]:
    """Largest abs/rel differences per quantity, the first divergence, and whether everything is within tolerance.

    The first divergence is at the earliest step where a gradient or a parameter is out of tolerance: the first
    such parameter in forward ``order``, its gradient if that diverges, else its value after the step.
    """
    if other["names"] != reference["names"]:
        raise ConfigRunError("the configuration's model has different parameters from single's")
    names = reference["names"]
    position = {name: i for i, name in enumerate(names)}
    ranked = [n for n in order if n in position] + [n for n in names if n not in order]
    max_abs = {"loss": 0.0, "gradient": 0.0, "parameter": 0.0}
    max_rel = dict(max_abs)
    ok = True
    first: dict[str, Any] | None = None

    def within(quantity: str, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool, float, float]:
        d, r, scale = _difference(a, b)
        max_abs[quantity], max_rel[quantity] = max(max_abs[quantity], d), max(max_rel[quantity], r)
        return d <= atol + rtol * scale, d, r

    for step in range(len(reference["losses"])):
        loss_ok, _, _ = within(
            "loss",
            torch.tensor(other["losses"][step], dtype=torch.float64),
            torch.tensor(reference["losses"][step], dtype=torch.float64),
        )
        ok = ok and loss_ok
        for rank, name in enumerate(ranked, start=1):
            i = position[name]
            for quantity, key in (("gradient", "grads"), ("parameter", "params")):
                same, d, r = within(quantity, other[key][step][i], reference[key][step][i])
                if not same:
                    ok = False
                    if first is None:
                        first = {
                            "step": step + 1,
                            "parameter": name,
                            "position": rank,
                            "quantity": quantity,
                            "abs": d,
                            "rel": r,
                        }
    return max_abs, max_rel, first, ok


# -- the command -------------------------------------------------------------------------------------------------


def verify(config: VerifyConfig | None = None, /, **settings: Any) -> VerifyReport:
    """Run every configuration and compare it with ``single``; see the module docstring.

    ``verify(model="mlp", configs=["single", "ddp:2"])`` is ``verify(VerifyConfig(model="mlp", ...))``.

    Raises:
        ConfigError: settings no run can use.
    """
    config = settings_from(VerifyConfig, config, settings)
    configs = parse_configs(config.configs)
    single = next((c for c in configs if c.strategy == "single"), None) or parse_configs(["single"])[0]
    work = Workload.load(config)
    model = work.build_model()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # mixed precision computes in the lower precision whatever the parameters hold: its tolerance applies
    dtype = _COMPUTE_DTYPES.get(config.precision, dtype)
    rtol_default, atol_default = default_tolerance(dtype)
    rtol = config.rtol if config.rtol is not None else rtol_default
    atol = config.atol if config.atol is not None else atol_default
    sample = work.sample_batch(min(config.batch_size, 8))[0]
    order = forward_order(model, sample)
    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as tmp:
        workdir = Path(tmp)
        initial = workdir / "initial.pt"
        torch.save(model.state_dict(), initial)
        extra = {"initial_state": str(initial)}
        started = time.perf_counter()
        reference = run_config(run_in, config, single, workdir, extra)[0]
        single_seconds = time.perf_counter() - started
        verdicts = []
        for run in configs:
            if run == single:
                verdicts.append(_verdict_for(run, reference, reference, order, rtol, atol, config, model, sample))
                verdicts[-1].seconds = single_seconds
                continue
            why_not = unavailable_reason(run)
            if why_not is not None:
                verdicts.append(ConfigVerdict(run.word, SKIPPED, why_not, run.device_count))
                continue
            started = time.perf_counter()
            try:
                result = run_config(run_in, config, run, workdir, extra)[0]
            except ConfigRunError as exc:
                verdicts.append(ConfigVerdict(run.word, ERROR, str(exc), run.device_count))
                continue
            verdict = _verdict_for(run, reference, result, order, rtol, atol, config, model, sample)
            verdict.seconds = time.perf_counter() - started
            verdicts.append(verdict)
    report = VerifyReport(asdict(config), rtol, atol, verdicts, order)
    if config.report_out:
        write_json(report.as_dict(), config.report_out)
        report.written.append(config.report_out)
    return report


def _verdict_for(
    run: RunConfig,
    reference: dict[str, Any],
    result: dict[str, Any],
    order: list[str],
    rtol: float,
    atol: float,
    settings: VerifyConfig,
    model: torch.nn.Module,
    sample: torch.Tensor,
) -> ConfigVerdict:
    max_abs, max_rel, first, ok = compare(reference, result, order, rtol, atol)
    verdict = ConfigVerdict(run.word, PASS if ok else FAIL, "", run.device_count, max_abs, max_rel, first)
    if not ok:
        verdict.causes = [asdict(c) for c in _causes(run, reference, result, settings, model, sample)]
    return verdict


def _causes(
    run: RunConfig,
    reference: dict[str, Any],
    result: dict[str, Any],
    settings: VerifyConfig,
    model: torch.nn.Module,
    sample: torch.Tensor,
) -> list[Cause]:
    causes: list[Cause] = []
    summed = sum_loss_cause(reference["grads"][0], result["grads"][0], run.device_count, settings.loss)
    if summed is not None:
        causes.append(summed)
    split = run.device_count > 1  # the batch is cut into shares: per-share statistics and random streams differ
    if split:
        for found in (batchnorm_cause(model, run.strategy), dropout_cause(model)):
            if found is not None:
                causes.append(found)
    known_dropout = any(c.name == "dropout" for c in causes)
    for found in randomness_causes(model, sample, settings.seed, known_dropout):
        if split or found.name == "nondeterminism":
            causes.append(found)
    return causes
