"""MNIST from its IDX files: found in a folder (gzipped or plain), or downloaded there and checksummed.

    splits = load_mnist("data/mnist")             # the four files there, downloaded when missing
    splits = load_mnist("data/mnist", verify=False)   # a deliberately different copy

Every file is checked before use: gzipped files (downloaded or found) against their published md5, plain ones
against the release's label counts and brightness (no checksum is published for them), and every file's IDX
header against its size. A bad file is a :class:`~paratrain.errors.DataError` naming it and what to do.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import tempfile
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from paratrain.errors import DataError
from paratrain.training.data import DatasetSplits, TensorData, default_cache_dir, normalise

__all__ = ["load_mnist"]

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


def load_mnist(
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
    return TensorData(normalise(pixels), torch.from_numpy(labels).long())


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
