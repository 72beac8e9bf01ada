"""The datasets of ``paratrain train``, each split held whole as tensors.

Every image dataset is normalised like torchvision's ``ToTensor()`` + ``Normalize((0.5,), (0.5,))``: pixels in
[0, 1], then ``(x - 0.5) / 0.5``, so values lie in [-1, 1] and the tutorial's SimpleNet (784 inputs) runs unchanged::

    splits = load_dataset("digits")              # offline: 1,797 8x8 digits, shipped with paratrain, as 28x28
    splits.train.inputs.shape                    # (1437, 1, 28, 28)
    splits = load_dataset("digits60k")           # 60,000 shifted, noisy copies of the digits train split
    splits = load_dataset("mnist", "data/mnist") # the IDX files there, downloaded into it when missing
    splits = load_dataset("random")              # the DataParallel demo's 100 random vectors of 5 features
    train = splits.train.to("cuda")

The ``digits`` and ``digits60k`` results are cached in-process and shared between callers: treat their tensors as
read-only (``TensorData.to`` and indexing make copies; in-place ops would change every later load).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.client
import io
import math
import os
import tempfile
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError, DataError

__all__ = ["DATASET_NAMES", "DatasetSplits", "TensorData", "default_cache_dir", "load_dataset"]

DATASET_NAMES = ("digits", "digits60k", "mnist", "random")

_DIGITS_TRAIN = 1437  # of 1,797: the remaining 360 are the test split
_DIGITS60K_SIZE = 60_000  # MNIST's training set size
_MAX_SHIFT = 2  # pixels, each direction, on the 28x28 image
_NOISE_STD = 0.1  # in the normalised scale, where the pixel range is 2 wide
_SIDE = 28

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
# HTTPS first; the last one is plain HTTP, which is safe only because every file is checked against its md5
_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
# Uncompressed IDX files have no published checksum (the mirrors publish the gzipped files' md5): a plain file
# is checked against what the MNIST release holds instead: the count of every label, exactly, and the images'
# mean brightness (0..255), which random or foreign bytes do not reproduce.
_MNIST_LABEL_COUNTS = {
    "train": (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    "t10k": (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
}
_MNIST_MEAN_PIXEL = {"train": 33.32, "t10k": 33.79}  # torchvision's normalisation constants, 0.1307 and 0.1325
_MEAN_PIXEL_TOLERANCE = 0.5
_DOWNLOAD_TIMEOUT_S = 30.0
_IDX_IMAGES = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS = 0x00000801  # unsigned byte, 1 dimension


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise; compare by identity
class TensorData:
    """A whole split held as tensors: ``inputs`` (N, ...) float32 and ``targets`` (N,) int64."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.targets.dim() != 1 or self.inputs.dim() < 1 or self.inputs.size(0) != self.targets.size(0):
            raise ConfigError(
                f"inputs of shape {tuple(self.inputs.shape)} and targets of shape {tuple(self.targets.shape)} do "
                f"not pair up; expected inputs (N, ...) and targets (N,) with the same N"
            )

    def __len__(self) -> int:
        return self.targets.size(0)

    def to(self, device: torch.device | str | int) -> TensorData:
        """Both tensors on ``device`` (the same object's tensors when they are already there)."""
        return TensorData(self.inputs.to(device), self.targets.to(device))


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise; compare by identity
class DatasetSplits:
    """A dataset's train and test splits, with what a model needs to know about it."""

    name: str
    train: TensorData
    test: TensorData
    num_classes: int
    input_shape: tuple[int, ...]  # one sample's shape, e.g. (1, 28, 28) or (5,)


def default_cache_dir() -> Path:
    """Where downloaded datasets go: ``$XDG_CACHE_HOME/paratrain``, or ``~/.cache/paratrain``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # the XDG spec says relative values are invalid and must be ignored
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "paratrain"


def load_dataset(
    name: str, data_dir: str | Path | None = None, *, download: bool = True, verify: bool = True
) -> DatasetSplits:
    """Load one of ``DATASET_NAMES`` as whole tensors on the CPU.

    Args:
        name: ``"digits"``, ``"digits60k"``, ``"mnist"`` or ``"random"``.
        data_dir: the folder holding the MNIST IDX files (default ``default_cache_dir() / "mnist"``); the other
            datasets need no files and ignore it.
        download: fetch missing MNIST files into ``data_dir``.
        verify: check MNIST files found on disk as downloads are checked: gzipped files against their published
            md5, plain ones against the release's label counts and mean brightness. ``False`` uses a deliberately
            different copy (``paratrain train --no-verify-data``).

    Raises:
        ConfigError: an unknown name.
        DataError: MNIST files that are missing and cannot be downloaded, or are corrupt.
    """
    if name == "digits":
        return _digits()
    if name == "digits60k":
        return _digits60k()
    if name == "mnist":
        return _load_mnist(data_dir, download=download, verify=verify)
    if name == "random":
        return _random()
    raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")


def _normalise(pixels01: torch.Tensor) -> torch.Tensor:
    # torchvision's Normalize((0.5,), (0.5,)): [0, 1] -> [-1, 1]
    return (pixels01 - 0.5) / 0.5


# --- digits -----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _digits() -> DatasetSplits:
    inputs, targets = _read_digits_asset()
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(0))
    train_idx, test_idx = order[:_DIGITS_TRAIN], order[_DIGITS_TRAIN:]
    return DatasetSplits(
        name="digits",
        train=TensorData(inputs[train_idx], targets[train_idx]),
        test=TensorData(inputs[test_idx], targets[test_idx]),
        num_classes=10,
        input_shape=(1, _SIDE, _SIDE),
    )


def _read_digits_asset() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits from the package data, upsampled to (1797, 1, 28, 28) and normalised."""
    asset = resources.files("paratrain.training").joinpath("_assets/digits.csv.gz")
    try:
        table = np.loadtxt(io.BytesIO(gzip.decompress(asset.read_bytes())), delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, ValueError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read the digits shipped with paratrain ({asset}): {e}; reinstall paratrain") from e
    if table.shape[1] != 65 or table.shape[0] == 0:
        raise DataError(
            f"the digits shipped with paratrain ({asset}) have shape {table.shape}; expected rows of 64 pixels and "
            f"a label (65 columns); reinstall paratrain"
        )
    pixels = torch.from_numpy(table[:, :64]).float().div_(16.0).view(-1, 1, 8, 8)  # values 0..16 -> [0, 1]
    # bilinear upsampling mixes neighbours convexly, so values stay within [0, 1]
    pixels = F.interpolate(pixels, size=(_SIDE, _SIDE), mode="bilinear", align_corners=False)
    return _normalise(pixels).contiguous(), torch.from_numpy(table[:, 64].copy())


@functools.lru_cache(maxsize=1)
def _digits60k() -> DatasetSplits:
    digits = _digits()
    # built from the train split only, so no test image leaks into training
    train = _augment(digits.train, _DIGITS60K_SIZE, max_shift=_MAX_SHIFT, noise_std=_NOISE_STD, seed=0)
    return DatasetSplits("digits60k", train, digits.test, digits.num_classes, digits.input_shape)


def _augment(base: TensorData, size: int, *, max_shift: int, noise_std: float, seed: int) -> TensorData:
    """``size`` shifted, noisy copies of the (N, 1, H, W) images in ``base``, identical for the same arguments.

    Every base image is used ``size // N`` or one more times, in shuffled order; each copy is translated by up to
    ``max_shift`` pixels in each direction (the uncovered border is background) and gets Gaussian noise of
    ``noise_std``, clamped to the normalised range [-1, 1].
    """
    generator = torch.Generator().manual_seed(seed)
    n = len(base)
    source = (torch.arange(size) % n)[torch.randperm(size, generator=generator)]  # (size,)
    span = 2 * max_shift + 1
    shift_ids = torch.randint(0, span * span, (size,), generator=generator)  # (size,): one of span^2 translations
    # pad with background (-1 is pixel value 0 after normalisation), then crop a window per sample: the loop
    # runs over the span^2 translations, never over samples
    padded = F.pad(base.inputs, (max_shift,) * 4, value=-1.0)  # (N, 1, H + 2s, W + 2s)
    height, width = base.inputs.shape[-2:]
    out = torch.empty((size, *base.inputs.shape[1:]), dtype=base.inputs.dtype)
    for shift_id in range(span * span):
        rows = (shift_ids == shift_id).nonzero().squeeze(1)
        top, left = divmod(shift_id, span)
        out[rows] = padded[source[rows], :, top : top + height, left : left + width]
    if noise_std > 0:
        out.add_(torch.randn(out.shape, generator=generator), alpha=noise_std).clamp_(-1.0, 1.0)
    return TensorData(out, base.targets[source])


# --- random -----------------------------------------------------------------------------------------------------


def _random() -> DatasetSplits:
    # the DataParallel demo's RandomDataset(5, 100): inputs drawn first, so the train inputs equal the demo's data
    generator = torch.Generator().manual_seed(0)
    splits = []
    for _ in ("train", "test"):
        inputs = torch.randn(100, 5, generator=generator)
        targets = torch.randint(0, 2, (100,), generator=generator)
        splits.append(TensorData(inputs, targets))
    return DatasetSplits("random", splits[0], splits[1], num_classes=2, input_shape=(5,))


# --- mnist ------------------------------------------------------------------------------------------------------


def _load_mnist(
    data_dir: str | Path | None,
    *,
    download: bool,
    verify: bool = True,
    mirrors: Sequence[str] | None = None,
    timeout: float | None = None,
    checksums: Mapping[str, str] | None = None,
) -> DatasetSplits:
    """MNIST from the IDX files in ``data_dir``; ``mirrors``, ``timeout`` and ``checksums`` exist for tests."""
    directory = Path(data_dir) if data_dir is not None else default_cache_dir() / "mnist"
    if _missing_files(directory) and download:
        _download_mnist(
            directory,
            _MNIST_MIRRORS if mirrors is None else mirrors,
            _DOWNLOAD_TIMEOUT_S if timeout is None else timeout,
            _MNIST_MD5 if checksums is None else checksums,
        )
    missing = _missing_files(directory)
    if missing:
        raise DataError(
            _missing_message(directory, missing, "still missing after downloading" if download else "download=False")
        )
    known = (_MNIST_MD5 if checksums is None else checksums) if verify else None
    train = _read_mnist_split(directory, "train", known)
    test = _read_mnist_split(directory, "t10k", known)
    return DatasetSplits("mnist", train, test, num_classes=10, input_shape=(1, _SIDE, _SIDE))


def _find(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _missing_files(directory: Path) -> list[str]:
    return [name for name in _MNIST_FILES if _find(directory, name) is None]


def _missing_message(directory: Path, missing: Sequence[str], why: str) -> str:
    return (
        f"MNIST files missing from {directory}: {', '.join(missing)} ({why}). Put them in that folder, each either "
        f"gzipped (name + '.gz') or plain, or pass a data_dir that holds all four"
    )


def _download_mnist(directory: Path, mirrors: Sequence[str], timeout: float, checksums: Mapping[str, str]) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(_missing_message(directory, _missing_files(directory), f"cannot create the folder: {e}")) from e
    for name in _missing_files(directory):
        gz_name = f"{name}.gz"
        failures = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + gz_name
            try:
                _fetch(url, directory / gz_name, timeout, checksums[gz_name])
                break
            except (OSError, http.client.HTTPException) as e:  # URLError and timeouts are OSErrors
                failures.append(f"{url}: {e}")
        else:
            why = "download failed: " + "; ".join(failures)
            raise DataError(_missing_message(directory, _missing_files(directory), why))


def _fetch(url: str, dest: Path, timeout: float, md5: str) -> None:
    """Download ``url`` to ``dest`` through a temporary file, so an interrupted download never looks complete."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise DataError(
                f"{url} downloaded with md5 {digest.hexdigest()} but {dest.name} should have md5 {md5}; the download "
                f"was deleted. Try again later, or put the files in {dest.parent} yourself (gzipped or plain)"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _read_mnist_split(directory: Path, prefix: str, checksums: Mapping[str, str] | None) -> TensorData:
    """One split's tensors; with ``checksums``, each file is first checked to be MNIST's (see _MNIST_LABEL_COUNTS)."""
    images_path = _find(directory, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(directory, f"{prefix}-labels-idx1-ubyte")
    if images_path is None or labels_path is None:  # checked by the caller; kept for the type checker
        raise DataError(_missing_message(directory, _missing_files(directory), "removed while loading"))
    images = _read_idx(images_path, _IDX_IMAGES, checksums)  # (N, rows, cols) uint8
    labels = _read_idx(labels_path, _IDX_LABELS, checksums)  # (N,) uint8
    if images.shape[1:] != (_SIDE, _SIDE):
        raise DataError(
            f"{images_path} holds images of {images.shape[1]}x{images.shape[2]} pixels; MNIST images are "
            f"{_SIDE}x{_SIDE}. Replace it with the MNIST file"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds {labels.shape[0]} labels; "
            f"they must pair up. Replace both with files from the same MNIST release"
        )
    if labels.size and int(labels.max()) > 9:
        bad = int(np.argmax(labels > 9))
        raise DataError(
            f"{labels_path} has label {int(labels[bad])} at index {bad}; MNIST labels are 0..9. "
            f"The file is corrupt or not MNIST: replace it"
        )
    if checksums is not None:
        _check_plain(labels_path, labels, images_path, images, prefix)
    pixels = torch.from_numpy(images).unsqueeze(1).float().div_(255.0)  # (N, 1, 28, 28) in [0, 1]
    return TensorData(_normalise(pixels), torch.from_numpy(labels).long())


_USE_ANOTHER_COPY = (
    "Delete it to download it again, or, to train on a deliberately different copy, pass --no-verify-data "
    "(load_dataset(..., verify=False))"
)


def _check_plain(labels_path: Path, labels: np.ndarray, images_path: Path, images: np.ndarray, prefix: str) -> None:
    """Uncompressed files: the release's label counts, exactly, and its mean brightness (gzipped: md5, earlier)."""
    if labels_path.suffix != ".gz":
        counts = tuple(int(c) for c in np.bincount(labels, minlength=10))
        if counts != _MNIST_LABEL_COUNTS[prefix]:
            raise DataError(
                f"{labels_path} is not MNIST's {prefix} labels file: its label counts are {list(counts)}, MNIST's "
                f"are {list(_MNIST_LABEL_COUNTS[prefix])}. {_USE_ANOTHER_COPY}"
            )
    if images_path.suffix != ".gz":
        mean = float(images.mean(dtype=np.float64)) if images.size else 0.0
        expected = _MNIST_MEAN_PIXEL[prefix]
        if len(images) != len(labels) or abs(mean - expected) > _MEAN_PIXEL_TOLERANCE:
            raise DataError(
                f"{images_path} is not MNIST's {prefix} images file: {len(images)} images of mean brightness "
                f"{mean:.2f}, where MNIST has {sum(_MNIST_LABEL_COUNTS[prefix])} of {expected:.2f}. {_USE_ANOTHER_COPY}"
            )


def _read_idx(path: Path, magic: int, checksums: Mapping[str, str] | None = None) -> np.ndarray:
    """The uint8 array in an IDX file (plain or gzipped), after checking its header against its size.

    With ``checksums``, a gzipped file is first checked against its md5 there (the published one).
    """
    kind = "image" if magic == _IDX_IMAGES else "label"
    fix = "delete it to download it again, or replace it with the MNIST file"
    try:
        raw = path.read_bytes()
        if checksums is not None and path.name in checksums:
            found_md5 = hashlib.md5(raw, usedforsecurity=False).hexdigest()
            if found_md5 != checksums[path.name]:
                raise DataError(
                    f"{path} has md5 {found_md5}, but MNIST's {path.name} has md5 {checksums[path.name]}: the file "
                    f"is damaged or another copy. {_USE_ANOTHER_COPY}"
                )
        data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"cannot read {path}: {e}; {fix}") from e
    if len(data) < 4:
        raise DataError(f"{path} is truncated: {len(data)} bytes, too short for an IDX header; {fix}")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise DataError(
            f"{path} starts with magic number 0x{found:08x}, expected 0x{magic:08x} (an IDX {kind} file of unsigned "
            f"bytes); the file is corrupt or not an MNIST {kind} file: {fix}"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path} is truncated: {len(data)} bytes, but its {ndim}-d IDX header needs {header}; {fix}")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big", signed=True) for i in range(ndim))
    if any(d < 0 for d in shape):
        raise DataError(f"{path} has a negative size in its IDX header {shape}; {fix}")
    expected = header + math.prod(shape)
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise DataError(
            f"{path} is {what}: its header gives shape {shape}, which needs {expected} bytes, but it has "
            f"{len(data)}; {fix}"
        )
    array: np.ndarray = np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()
    return array
