"""What ``paratrain train --log-dir DIR`` writes, from rank 0 only: TensorBoard events, metrics.csv, curves.png.

    check_extras(tensorboard=True, plot=None)       # ConfigError naming a package asked for and missing
    log = RunLog("runs/a", tensorboard=None, plot=None, resume_step=None)   # None: where the package is there
    log.missing_note()                              # the one line saying what the missing extras would add
    log.scalars({"train/loss": 0.41, "train/lr": 0.01}, step=100, epoch=0)
    log.plot()                                      # curves.png from metrics.csv
    log.close()

metrics.csv needs nothing: TensorBoard event files and curves.png are written where their package is installed
(``None``, the default), required (``True``: ``--tensorboard``, ``--plot``, ``--log-with tensorboard``: a usage
error without it) or left out (``False``).

``metrics.csv`` has one row per value (``step,epoch,name,value``), so series logged at different moments (every
few steps, every epoch) share one file that any spreadsheet or ``csv`` module reads. The TensorBoard event
files hold the same series under the same names. A resumed run keeps the rows up to its checkpoint's step and
appends after them; TensorBoard purges the later events the same way.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.files import atomic_writer

__all__ = ["CSV_NAME", "PLOT_NAME", "RunLog", "check_extras", "install_hint", "read_metrics"]

CSV_NAME = "metrics.csv"
PLOT_NAME = "curves.png"
_COLUMNS = ("step", "epoch", "name", "value")
# what each optional output needs: (what it writes, the package, the extra to install, the flag to do without)
_EXTRAS = {
    "tensorboard": ("TensorBoard event files", "tensorboard", "paratrain[tensorboard]", "--no-tensorboard"),
    "plot": ("curves.png", "matplotlib", "paratrain[plot]", "--no-plot"),
}


def install_hint(extra: str) -> str:
    """How to install one of paratrain's extras, from PyPI or in a clone of the repository."""
    return f"pip install 'paratrain[{extra}]' (in a clone of paratrain: pip install -e '.[{extra}]')"


def _missing(extra: str, error: BaseException | None = None, flag: str | None = None) -> ConfigError:
    writes, package, install, _ = _EXTRAS[extra]
    found = f" ({error})" if error is not None else ""
    asked = flag or f"--{extra}"
    return ConfigError(
        f"{asked} asks for {writes}, which need the {package} package, not importable here{found}: "
        f"{install_hint(install.removeprefix('paratrain[').removesuffix(']'))}, or drop {asked} ({CSV_NAME} needs "
        f"nothing; without the flag they are written only where the package is installed)"
    )


def check_extras(*, tensorboard: bool | None, plot: bool | None, tensorboard_flag: str = "--tensorboard") -> None:
    """Raise ConfigError when an optional package asked for (``True``, by ``--tensorboard`` / ``--plot`` or
    ``tensorboard_flag``) is not installed (cheap: nothing is imported); one left to its default (``None``) is only
    left out, by :class:`RunLog`."""
    for extra, wanted in (("tensorboard", tensorboard), ("plot", plot)):
        if wanted and importlib.util.find_spec(_EXTRAS[extra][1]) is None:
            raise _missing(extra, flag=tensorboard_flag if extra == "tensorboard" else None)


class RunLog:
    """The log directory of one run (main process only).

    Args:
        directory: created if missing.
        tensorboard: write TensorBoard event files (imports ``torch.utils.tensorboard`` now, not mid-run); None:
            when the package can be imported, else they are left out and listed in :attr:`missing`.
        plot: draw ``curves.png`` on :meth:`plot` (imports matplotlib now); None as for ``tensorboard``.
        resume_step: the last optimizer step a resumed run's checkpoint covers (counted from 0); rows and events
            after it are dropped. None for a fresh run, which starts a new metrics.csv.

    Raises:
        ConfigError: an optional package asked for (True) that cannot be imported, or a directory that cannot be
            written.
    """

    def __init__(
        self, directory: str | Path, *, tensorboard: bool | None, plot: bool | None, resume_step: int | None
    ) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"--log-dir {directory}: cannot create it ({exc.strerror}); pick a writable path"
            ) from exc
        self.missing: list[str] = []  # the extras left out because their package is not there (in _EXTRAS)
        self._writer: Any = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                if tensorboard:
                    raise _missing("tensorboard", exc) from exc
                self.missing.append("tensorboard")
            else:
                purge = {} if resume_step is None else {"purge_step": resume_step + 1}
                self._writer = SummaryWriter(str(self.directory), **purge)
        self._figure: Any = None
        if plot is not False:
            try:
                from matplotlib.figure import Figure
            except ImportError as exc:
                if plot:
                    raise _missing("plot", exc) from exc
                self.missing.append("plot")
            else:
                self._figure = Figure
        self.csv_path = self.directory / CSV_NAME
        kept = [] if resume_step is None else [r for r in read_metrics(self.csv_path) if int(r["step"]) <= resume_step]
        self._file = self.csv_path.open("w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(_COLUMNS)
        self._csv.writerows([r[c] for c in _COLUMNS] for r in kept)
        self._file.flush()

    def missing_note(self) -> str | None:
        """One sentence saying what this directory gets and what the missing extras would add; None when none is
        missing."""
        if not self.missing:
            return None
        adds = " and ".join(_EXTRAS[extra][0] for extra in self.missing)
        flags = " ".join(_EXTRAS[extra][3] for extra in self.missing)
        return (
            f"--log-dir {self.directory} gets {CSV_NAME} only: {install_hint(','.join(self.missing))} adds {adds} "
            f"({flags}: no note)"
        )

    def scalars(self, values: dict[str, float], *, step: int, epoch: int) -> None:
        """One value per series at optimizer step ``step`` of ``epoch``, both counted from 0 as on the console
        (the first step is step 0 of epoch 0)."""
        for name, value in values.items():
            self._csv.writerow((step, epoch, name, repr(float(value))))
            if self._writer is not None:
                self._writer.add_scalar(name, value, step)
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def plot(self) -> Path | None:
        """Draw ``curves.png`` from metrics.csv: train loss against steps, test accuracy against epochs.

        Returns its path (None when plotting is off).
        """
        if self._figure is None:
            return None
        rows = read_metrics(self.csv_path)

        def series(name: str, by_epoch: bool = False, scale: float = 1.0) -> list[tuple[float, float]]:
            x = "epoch" if by_epoch else "step"
            return [(float(r[x]), float(r["value"]) * scale) for r in rows if r["name"] == name]

        figure = self._figure(figsize=(10, 4), dpi=100)
        loss_axes, accuracy_axes = figure.subplots(1, 2)
        for name, style, label in (("train/loss", "-", "logged steps"), ("epoch/train_loss", "o", "epoch mean")):
            points = series(name)
            if points:
                loss_axes.plot(*zip(*points, strict=True), style, label=label)
        loss_axes.set(title="train loss", xlabel="optimizer step (from 0)", ylabel="cross-entropy")
        if loss_axes.lines:
            loss_axes.legend()
        accuracy = series("epoch/test_accuracy", by_epoch=True, scale=100.0)  # in percent, as the console says
        if accuracy:
            accuracy_axes.plot(*zip(*accuracy, strict=True), "o-")
        accuracy_axes.set(title="test accuracy after each epoch", xlabel="epoch (from 0)", ylabel="accuracy (%)")
        figure.tight_layout()
        path = self.directory / PLOT_NAME
        with atomic_writer(path, "wb") as file:
            figure.savefig(file, format="png")
        return path

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv (none when the file does not exist)."""
    if not Path(path).exists():
        return []
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))
