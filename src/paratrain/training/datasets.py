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
import io
import zlib
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from paratrain.errors import ConfigError, DataError
from paratrain.training.data import DatasetSplits, TensorData, normalise

__all__ = ["DATASET_NAMES", "dataset_shape", "load_dataset"]

DATASET_NAMES = ("digits", "digits60k", "mnist", "random")

_DIGITS_TRAIN = 1437  # of 1,797: the remaining 360 are the test split
_DIGITS60K_SIZE = 60_000  # MNIST's training set size
_MAX_SHIFT = 2  # pixels, each direction, on the 28x28 image
_NOISE_STD = 0.1  # in the normalised scale, where the pixel range is 2 wide
_SIDE = 28
RANDOM_SAMPLES = 1024  # per split, for random data of a given shape


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    download: bool = True,
    verify: bool = True,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int = 10,
    samples: int = RANDOM_SAMPLES,
    seed: int = 0,
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
        input_shape, num_classes, samples, seed: ``random`` only: ``samples`` random inputs of ``input_shape``
            per split, drawn from ``seed``, with targets in ``0..num_classes - 1``. Without ``input_shape``, the
            DataParallel demo's 100 vectors of 5 features in 2 classes.

    Raises:
        ConfigError: an unknown name.
        DataError: MNIST files that are missing and cannot be downloaded, or are corrupt.
    """
    if name == "digits":
        return _digits()
    if name == "digits60k":
        return _digits60k()
    if name == "mnist":
        from paratrain.training.mnist import load_mnist  # the download and IDX code loads only for MNIST

        return load_mnist(data_dir, download=download, verify=verify)
    if name == "random":
        return _random() if input_shape is None else _random_shaped(input_shape, num_classes, samples, seed)
    raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")


def dataset_shape(
    name: str, input_shape: tuple[int, ...] | None = None, num_classes: int = 10
) -> tuple[tuple[int, ...], int]:
    """(per-sample input shape, number of classes) of a dataset, without loading it (as :func:`load_dataset`
    would give them for the same arguments).

    Raises:
        ConfigError: an unknown name.
    """
    if name in ("digits", "digits60k", "mnist"):
        return (1, _SIDE, _SIDE), 10
    if name == "random":
        return ((5,), 2) if input_shape is None else (tuple(input_shape), num_classes)
    raise ConfigError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")


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
    return normalise(pixels).contiguous(), torch.from_numpy(table[:, 64].copy())


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


def _random_shaped(input_shape: tuple[int, ...], num_classes: int, samples: int, seed: int) -> DatasetSplits:
    """``samples`` standard-normal inputs of ``input_shape`` per split drawn from ``seed``, with uniform targets."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for _ in ("train", "test"):
        inputs = torch.randn(samples, *input_shape, generator=generator)
        targets = torch.randint(0, num_classes, (samples,), generator=generator)
        splits.append(TensorData(inputs, targets))
    return DatasetSplits("random", splits[0], splits[1], num_classes=num_classes, input_shape=tuple(input_shape))
