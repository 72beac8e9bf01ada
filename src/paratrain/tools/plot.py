"""The PNG of ``paratrain bench``: samples/s and scaling efficiency against devices, with the ideal lines.

matplotlib is an optional extra (``pip install 'paratrain[plot]'``); only this module imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..files import atomic_writer

if TYPE_CHECKING:
    from .bench import BenchReport

__all__ = ["plot_scaling"]


def plot_scaling(report: BenchReport, path: str | Path) -> Path:
    """Two panels: samples/s and efficiency per strategy against the number of devices; ideal lines dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    measured = [t for t in report.timings if t.status == "OK"]
    base = next((t for t in measured if t.strategy == "single"), None)
    fig, (throughput, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    most = max((t.devices for t in measured), default=1)
    for strategy in ("dp", "ddp"):
        points = sorted((t.devices, t.samples_per_second, t.efficiency) for t in measured if t.strategy == strategy)
        if base is not None:
            points.insert(0, (1, base.samples_per_second, 1.0))
        if len(points) > (1 if base is not None else 0):
            xs = [p[0] for p in points]
            throughput.plot(xs, [p[1] for p in points], marker="o", label=strategy)
            efficiency.plot(xs, [p[2] for p in points], marker="o", label=strategy)
    if base is not None:
        ideal = list(range(1, most + 1))
        throughput.plot(ideal, [base.samples_per_second * n for n in ideal], "k--", label="ideal")
        efficiency.plot(ideal, [1.0] * len(ideal), "k--", label="ideal")
    throughput.set(xlabel="devices", ylabel="samples/s", title="throughput")
    efficiency.set(xlabel="devices", ylabel="speed-up / devices", title="scaling efficiency", ylim=(0, 1.1))
    for axes in (throughput, efficiency):
        axes.set_xticks(range(1, most + 1))
        axes.grid(alpha=0.3)
        axes.legend()
    settings = report.settings
    fig.suptitle(f"paratrain bench: {settings['model']}, global batch {settings['batch_size']}")
    fig.tight_layout()
    target = Path(path)
    with atomic_writer(target, "wb") as file:
        fig.savefig(file, dpi=100, format="png")
    plt.close(fig)
    return target
