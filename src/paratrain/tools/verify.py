"""``paratrain verify``: does every parallel configuration train exactly like one device?

    paratrain verify                                          # every configuration this machine can run
    paratrain verify --model mypkg.nets:make_net --input-shape 3,32,32 --configs single dp:cpu,cpu ddp:2
    paratrain verify --loss sum --configs single ddp:2        # see what a summed loss does under ddp
    paratrain verify --configs single ddp:2 zero1:2 zero2:3 zero3:2   # the sharded strategies against one device

Every configuration starts from the same weights (built once here, saved, loaded by each) and trains on the same
global batches for ``--steps`` optimizer steps. Per step it records the global batch's loss, every parameter's
synchronised gradient (after backward, before the step) and the parameters after the step; each is compared
with ``single``'s, and passes when it is as close as the computation's rounding allows, measured against single
run in float64 (:mod:`paratrain.tools.verify_compare`). A configuration that differs beyond that is named with
the first parameter that diverges in forward order and the causes recognised. What this machine cannot run is
reported as skipped.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from paratrain.parallel import Parallel, seed_everything
from paratrain.settings import at_least, optional, setting
from paratrain.tools.configs import RunConfig, parse_configs, unavailable_reason
from paratrain.tools.diagnose import (
    Cause,
    batchnorm_cause,
    dropout_cause,
    forward_order,
    probe_forward,
    randomness_causes,
    sum_loss_cause,
)
from paratrain.tools.report import format_table, write_json
from paratrain.tools.runner import ConfigRunError, run_config
from paratrain.tools.settings import RunSettings, settings_from
from paratrain.tools.verify_compare import Tolerance, compare, fixed_tolerance
from paratrain.tools.workload import Workload, build_optimizer, endless

__all__ = ["ConfigVerdict", "VerifyConfig", "VerifyReport", "verify"]

PASS, FAIL, SKIPPED, ERROR = "PASS", "FAIL", "SKIPPED", "ERROR"

_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class VerifyConfig(RunSettings):
    """Settings of ``paratrain verify``."""

    rtol: float | None = setting(
        None,
        "compare with single within this tolerance, relative to each tensor's largest value, instead of the "
        "rounding measured against float64 (default: by dtype, with --atol)",
        check=optional(at_least(0)),
    )
    atol: float | None = setting(
        None, "with --rtol: the absolute tolerance (default: by dtype)", check=optional(at_least(0))
    )


@dataclass
class ConfigVerdict:
    """One configuration against single: the largest differences, the verdict and, when it fails, why."""

    config: str
    status: str  # PASS, FAIL, SKIPPED, ERROR
    reason: str = ""  # why skipped or failed to run
    devices: int = 1
    max_abs: dict[str, float] = field(default_factory=dict)  # loss, gradient, parameter
    max_rel: dict[str, float] = field(default_factory=dict)
    # float64 rule: per quantity, the largest distance from float64 in units of single's own (passes up to FACTOR)
    rounding: dict[str, float] = field(default_factory=dict)
    first_divergence: dict[str, Any] | None = None  # step, parameter, quantity, abs, rel
    causes: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class VerifyReport:
    """What ``verify`` found; :attr:`ok` is False when a configuration failed or could not run."""

    settings: dict[str, Any]
    tolerance: Tolerance
    verdicts: list[ConfigVerdict]
    forward_order: list[str]
    written: list[str] = field(default_factory=list)  # the files written (the JSON report)

    @property
    def rtol(self) -> float:
        return self.tolerance.rtol

    @property
    def atol(self) -> float:
        return self.tolerance.atol

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
            "tolerance": {**asdict(self.tolerance), "text": self.tolerance.describe()},
            "forward_order": self.forward_order,
            "configs": [asdict(v) for v in self.verdicts],
        }

    def render(self) -> str:
        measured = self.tolerance.rule == "float64"
        rows = []
        for v in self.verdicts:
            if v.status in (SKIPPED, ERROR):
                rows.append([v.config, "-", "-", "-", *(["-"] if measured else []), f"{v.status}: {v.reason}"])
                continue
            rounding = [f"{max(v.rounding.values(), default=0.0):.1f}x"] if measured else []
            rows.append(
                [v.config]
                + [f"{v.max_abs[q]:.2e} / {v.max_rel[q]:.2e}" for q in ("loss", "gradient", "parameter")]
                + rounding
                + [v.status]
            )
        headers = ["configuration", "loss abs/rel", "gradients abs/rel", "parameters abs/rel"]
        headers += ["rounding vs single's"] if measured else []
        lines = [
            format_table([*headers, "verdict"], rows),
            f"differences from single; tolerance: {self.tolerance.describe()}; {self.settings['steps']} steps, "
            f"global batch {self.settings['batch_size']}",
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
    exact = bool(extra.get("float64"))  # the reference run: parameters, data and every step in float64
    if exact:
        model = model.double()
    optimizer = build_optimizer(settings, model.parameters())
    model, optimizer, loader = par.prepare(model, optimizer, work.loader())
    if exact:  # after prepare's own hook, which knows the batch by the tensors the loader yielded
        model.register_forward_pre_hook(_to_float64)
    inner = par.unwrap(model)
    names = [n for n, _ in inner.named_parameters()]
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
        # whole, also where no process holds a whole gradient (zero2, zero3 gather their shards)
        grads.append([None if g is None else g.detach().to("cpu", copy=True) for g in par.gradients(model)])
        par.step(optimizer)
        state = inner.state_dict()  # the weights whole, also where each process holds a shard (zero3 gathers them)
        after.append([state[n].detach().to("cpu", copy=True) for n in names])
    return {"names": names, "losses": losses, "grads": grads, "params": after}


def _to_float64(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


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
    # mixed precision computes in the lower precision whatever the parameters hold: its rounding applies
    dtype = _COMPUTE_DTYPES.get(config.precision, dtype)
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
        tolerance, exact = _tolerance(config, single, workdir, extra, reference, dtype, model, sample)
        verdicts = []
        for run in configs:
            if run == single:
                verdicts.append(_verdict_for(run, reference, reference, order, tolerance, exact, config, model, sample))
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
            verdict = _verdict_for(run, reference, result, order, tolerance, exact, config, model, sample)
            verdict.seconds = time.perf_counter() - started
            verdicts.append(verdict)
    report = VerifyReport(asdict(config), tolerance, verdicts, order)
    if config.report_out:
        write_json(report.as_dict(), config.report_out)
        report.written.append(config.report_out)
    return report


def _tolerance(
    config: VerifyConfig,
    single: RunConfig,
    workdir: Path,
    extra: dict[str, Any],
    reference: dict[str, Any],
    dtype: torch.dtype,
    model: torch.nn.Module,
    sample: torch.Tensor,
) -> tuple[Tolerance, dict[str, Any] | None]:
    """The rule every configuration is judged by, and the float64 run it measures rounding against (if any)."""
    if config.rtol is not None or config.atol is not None:
        rtol, atol = fixed_tolerance(dtype)
        given = Tolerance.fixed(
            config.rtol if config.rtol is not None else rtol,
            config.atol if config.atol is not None else atol,
            dtype,
            "--rtol/--atol given",
        )
        return given, None
    # single again, exactly: float64 throughout and no autocast
    exact = run_config(run_in, replace(config, precision="32"), single, workdir, {**extra, "float64": True})[0]
    nondeterministic, _ = probe_forward(model, sample, config.seed)
    tolerance = Tolerance.entitled(reference, exact, dtype, nondeterministic)
    return tolerance, exact if tolerance.rule == "float64" else None


def _verdict_for(
    run: RunConfig,
    reference: dict[str, Any],
    result: dict[str, Any],
    order: list[str],
    tolerance: Tolerance,
    exact: dict[str, Any] | None,
    settings: VerifyConfig,
    model: torch.nn.Module,
    sample: torch.Tensor,
) -> ConfigVerdict:
    found = compare(reference, result, order, tolerance, exact)
    ok = found.ok
    verdict = ConfigVerdict(
        run.word, PASS if ok else FAIL, "", run.device_count, found.max_abs, found.max_rel, found.rounding, found.first
    )
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
