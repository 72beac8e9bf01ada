"""The PNG of ``paratrain bench``: samples/s and scaling efficiency against devices, with the ideal lines.

matplotlib is an optional extra (``pip install 'paratrain[plot]'``); only this module imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from paratrain.files import atomic_writer

__all__ = ["Point", "plot_scaling"]

Point = tuple[int, float, float]  # devices, samples/s, efficiency


def plot_scaling(series: Mapping[str, Sequence[Point]], single: float | None, title: str, path: str | Path) -> Path:
    """Two panels: samples/s and efficiency per strategy against the number of devices; ideal lines dashed.

    ``series`` maps each strategy to its measured points; ``single`` is one device's samples/s (None when not
    measured), drawn as every series' first point and as the base of the ideal lines.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (throughput, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    most = max((p[0] for points in series.values() for p in points), default=1)
    for strategy, measured in series.items():
        points = sorted(measured)
        if single is not None:
            points.insert(0, (1, single, 1.0))
        if len(points) > (1 if single is not None else 0):
            xs = [p[0] for p in points]
            throughput.plot(xs, [p[1] for p in points], marker="o", label=strategy)
            efficiency.plot(xs, [p[2] for p in points], marker="o", label=strategy)
    if single is not None:
        ideal = list(range(1, most + 1))
        throughput.plot(ideal, [single * n for n in ideal], "k--", label="ideal")
        efficiency.plot(ideal, [1.0] * len(ideal), "k--", label="ideal")
    throughput.set(xlabel="devices", ylabel="samples/s", title="throughput")
    efficiency.set(xlabel="devices", ylabel="speed-up / devices", title="scaling efficiency", ylim=(0, 1.1))
    for axes in (throughput, efficiency):
        axes.set_xticks(range(1, most + 1))
        axes.grid(alpha=0.3)
        axes.legend()
    fig.suptitle(title)
    fig.tight_layout()
    target = Path(path)
    with atomic_writer(target, "wb") as file:
        fig.savefig(file, dpi=100, format="png")
    plt.close(fig)
    return target
