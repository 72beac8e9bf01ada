"""``paratrain plan``'s report: the rows, the assumptions in words, whether to trust them, and the verdict.

    reasons = unreliable_reasons(rows, moved={(64, 2): 0.4}, bound=MOVED_BOUND)   # [] when the inputs held still
    report = PlanReport(settings, rows, recommended, assumptions, inputs, unreliable=reasons)
    print(report.render())

A prediction is only as good as its measurements. On a busy machine they lie: a process waiting for cores it
does not get (OpenMP threads spin for them) measures one device ten times slower than it is, and N devices then
look more than N times faster. So a prediction of more than 100% efficiency, or measurements whose medians moved
between repeats by more than :data:`MOVED_BOUND`, are reported as unreliable, with the advice to measure again on a
quieter machine, and never become a recommendation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from paratrain.ddp.buckets import FIRST_BUCKET_BYTES
from paratrain.tools.plan_fit import CommFit
from paratrain.tools.plan_measure import DDP_BUCKET_CAP_BYTES
from paratrain.tools.plan_memory import MemoryRow, parse_bytes, render_memory, smallest_fit
from paratrain.tools.plan_model import BucketSpec, Link, ScalingRow
from paratrain.tools.report import format_table
from paratrain.tools.settings import RunSettings

__all__ = ["MOVED_BOUND", "PlanReport", "describe_assumptions", "unreliable_reasons", "unreliable_verdict"]

# a shape's median step moving more than this between repeats: the machine did not hold still. A shared 2-core VM
# moves medians by 10-30% between rounds while plan's prediction stays within 20% of what train measures; a
# machine that spoils the prediction moves them by several times
MOVED_BOUND = 0.5


def unreliable_reasons(
    rows: Sequence[ScalingRow], moved: Mapping[tuple[int, int], float], bound: float = MOVED_BOUND
) -> list[str]:
    """Why these predictions cannot be trusted (empty when nothing says so).

    ``moved`` maps each measured (per-device batch, threads) to how far its median step moved between repeats.
    """
    reasons = []
    for row in rows:
        if row.world_size > 1 and row.efficiency > 1.0:
            reasons.append(
                f"{row.world_size} devices are predicted {row.speedup:.2f}x faster than one (efficiency "
                f"{row.efficiency:.0%}), more than {row.world_size} devices can be"
            )
    for (batch, threads), change in sorted(moved.items()):
        if change > bound:
            reasons.append(
                f"the step at batch {batch} on {threads} thread{'s' * (threads != 1)} moved by {change:.0%} between "
                f"repeats (more than {bound:.0%})"
            )
    return reasons


def unreliable_verdict(reasons: Sequence[str], load_average: float | None, cores: int | None) -> str:
    """No recommendation, why not, and what to do."""
    busy = ""
    if load_average is not None and cores:
        busy = f" (its load average is {load_average:.1f} on {cores} cores)"
    listed = "; ".join(reasons) or "they could not be taken"
    return (
        f"no recommendation: the measurements are unreliable: {listed}. Other work on this machine{busy} changes "
        "what a step costs while plan measures it: run plan again on a quieter machine, with nothing else running"
    )


@dataclass
class PlanReport:
    """What plan predicts, from what, and what it recommends (None when the measurements are unreliable)."""

    settings: dict[str, Any]
    rows: list[ScalingRow]
    recommended: int | None
    assumptions: list[str]
    inputs: dict[str, Any]
    validation: list[dict[str, Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # the files written (the JSON report)
    unreliable: list[str] = field(default_factory=list)  # why the measurements cannot be trusted, if they cannot
    memory: list[MemoryRow] = field(default_factory=list)  # bytes per device of ddp, zero1 and zero2 at each N
    budget: list[str] = field(default_factory=list)  # what was measured, and whether a longer budget would matter

    @property
    def reliable(self) -> bool:
        return not self.unreliable

    @property
    def ok(self) -> bool:
        """False when a validated configuration's prediction error exceeds ``max_error``."""
        return all(v["within"] for v in self.validation if v.get("within") is not None)

    def row(self, world_size: int) -> ScalingRow:
        return next(r for r in self.rows if r.world_size == world_size)

    def as_dict(self) -> dict[str, Any]:
        return {
            "command": "plan",
            "ok": self.ok,
            "settings": self.settings,
            "rows": [asdict(r) for r in self.rows],
            "recommended_world_size": self.recommended,
            "reliable": self.reliable,
            "unreliable": self.unreliable,
            "assumptions": self.assumptions,
            "inputs": self.inputs,
            "validation": self.validation,
            "memory": [{**asdict(r), "model_states": r.model_states, "total": r.total} for r in self.memory],
            "fewest_devices": self.fewest_devices(),
            "budget": self.budget,
        }

    def fewest_devices(self) -> dict[str, int | None] | None:
        """With --device-memory: the fewest devices ddp, zero1 and zero2 fit on (None: not up to max-world-size)."""
        limit = self.settings.get("device_memory")
        return smallest_fit(self.memory, parse_bytes(limit)) if limit and self.memory else None

    def render(self) -> str:
        headers = [
            "world size",
            "batch/device",
            "step ms",
            "samples/s",
            "speed-up",
            "efficiency",
            "beyond compute ms",
            "source",
            "fit error",
        ]
        table = [
            [
                str(r.world_size),
                str(r.per_device_batch),
                f"{r.step_seconds * 1e3:.2f}",
                f"{r.samples_per_second:,.0f}",
                f"{r.speedup:.2f}x",
                f"{r.efficiency:.0%}",
                f"{r.exposed_comm_seconds * 1e3:.2f}" if r.world_size > 1 and r.comm_seconds else "-",
                r.source,
                f"{r.fit_error:+.0%}" if r.fit_error is not None else "-",
            ]
            for r in self.rows
        ]
        lines = [format_table(headers, table), *self.budget, "", "assumptions:"]
        lines += [f"  - {a}" for a in self.assumptions]
        if self.memory:
            limit = self.settings.get("device_memory")
            lines += ["", *render_memory(self.memory, parse_bytes(limit) if limit else None)]
            lines.append(
                "  step times above are ddp's; zero1 and zero2 are not modelled (measure them with bench --configs "
                "zero1:N zero2:N)"
            )
        lines.append("")
        lines.append(self.verdict())
        if self.validation:
            lines += ["", "validation against bench (measured here, now):"]
            vt = [
                [
                    v["config"],
                    f"{v['predicted_seconds'] * 1e3:.2f}" if v.get("predicted_seconds") else "-",
                    f"{v['measured_seconds'] * 1e3:.2f}" if v.get("measured_seconds") else "-",
                    f"{v['error']:+.1%}" if v.get("error") is not None else v.get("status", ""),
                ]
                for v in self.validation
            ]
            lines.append(format_table(["configuration", "predicted ms", "measured ms", "error"], vt))
            lines.append(f"  error = predicted / measured - 1; passes within +-{self.settings['max_error']:.0%}")
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.unreliable or self.recommended is None:
            return unreliable_verdict(self.unreliable, self.inputs.get("load_average"), self.inputs.get("cores"))
        slower = [r for r in self.rows if r.world_size > 1 and r.speedup < 1]
        n = self.recommended
        threshold = self.settings["min_efficiency"]
        if n == 1:
            two = next((r for r in self.rows if r.world_size == 2), None)
            detail = f" (2 devices: {two.speedup:.2f}x, efficiency {two.efficiency:.0%})" if two else ""
            head = f"recommendation: stay on 1 device: more devices do not pay off{detail}"
        else:
            r = self.row(n)
            head = (
                f"recommendation: up to {n} devices ({r.speedup:.2f}x, efficiency {r.efficiency:.0%}); past that, "
                f"efficiency falls below {threshold:.0%} or the speed-up stops growing"
            )
        if slower:
            listed = ", ".join(str(r.world_size) for r in slower)
            head += f"\nwarning: with {listed} devices a step is predicted SLOWER than on one device"
        return head


def describe_assumptions(
    config: RunSettings,
    device: str,
    cores: int,
    param_count: int,
    buckets: list[BucketSpec],
    measured: list[int],
    beyond: list[int],
    factors: dict[int, float],
    fit: CommFit,
    model_errors: dict[int, float],
    local_link: Link | None,
    remote_link: Link | None,
    per_node: int,
) -> list[str]:
    """What the prediction takes as given, in words, for the printed report."""
    gpus = device.startswith("cuda")
    assumptions: list[str] = []
    assumptions.append(
        f"model {config.model}: {param_count:,} parameters ({param_count * 4 / 2**20:.1f} MiB of float32 gradients), "
        f"{len(buckets)} bucket(s) as our DDP builds them (first {FIRST_BUCKET_BYTES // 2**20} MiB, then "
        f"{DDP_BUCKET_CAP_BYTES // 2**20} MiB): {', '.join(f'{b.nbytes / 2**20:.2f}' for b in buckets)} MiB"
    )
    words = ", ".join("single" if n == 1 else f"ddp:{n}" for n in measured)
    where = "one GPU per process" if gpus else f"on this machine's {cores} cores"
    assumptions.append(
        f"measured: world sizes {_sizes(measured)} ran the real job here ({words}: global batch {config.batch_size} "
        f"split N ways, the user's model, data and optimizer, at the threads paratrain train gives each process, "
        f"{where}); each row is that run's step, the median of its rounds' mean steps"
    )
    if not beyond:
        return assumptions
    factor_text = ", ".join(f"N={n}: x{f:.2f}" for n, f in sorted(factors.items()))
    assumptions.append(
        f"extrapolated: world sizes {_sizes(beyond)} from the model: compute measured on {device} in this process "
        f"at each per-device batch (and, on the CPU, the threads each process gets, slowed by N x threads / cores "
        f"beyond one process per core), scaled by how much slower the measured run computed than that profile "
        f"({factor_text})"
    )
    if local_link is not None:
        assumptions.append(
            f"all-reduce inside this machine ({'nccl' if gpus else 'gloo'}, measured between real processes): "
            f"{local_link.latency * 1e6:.0f} us + 2(N-1)/N x bytes / {local_link.bandwidth / 1e9:.2f} GB/s; "
            "overlap as our reducer runs it: a bucket's all-reduce starts when its gradients are ready, in bucket "
            "order, one at a time"
        )
    if remote_link is not None:
        assumptions.append(
            f"world sizes above {per_node} span machines: ring all-reduce over the link, "
            f"{remote_link.latency * 1e6:.0f} us + 2(N-1)/N x bytes / {remote_link.bandwidth / 1e9:.2f} GB/s"
        )
    if fit.points:
        before = ", ".join(f"ddp:{n} {e:+.0%}" for n, e in sorted(model_errors.items()))
        shape = "a constant" if fit.per_ring == 0.0 else "constant + per_ring x 2(N-1)/N"
        assumptions.append(
            f"fitted to the measured ddp runs: each ddp step adds {shape} to the model ({fit.constant * 1e3:+.2f} ms"
            + (f", {fit.per_ring * 1e3:+.2f} ms per unit" if fit.per_ring else "")
            + "): what the real step spent beyond the modelled one. The model's error before the fit (compute "
            f"unscaled, nothing added): {before}"
            + (
                "; with one measured ddp size the fit matches it exactly, so its error there says nothing of the "
                "extrapolation"
                if fit.points == 1
                else ""
            )
        )
    else:
        assumptions.append(
            "no ddp size could be measured here: the communication model is not fitted (the extrapolation is the "
            "model's alone)"
        )
    return assumptions


def _sizes(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
