from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paratrain.errors import ConfigError, DataError
from paratrain.training.datasets import (
    DATASET_NAMES,
    DatasetSplits,
    TensorData,
    _augment,
    _load_mnist,
    default_cache_dir,
    load_dataset,
)
from processes import run_cli

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
UNREACHABLE = ("http://127.0.0.1:9/",)  # the discard port: nothing listens, the connection is refused at once


def assert_image_split(data: TensorData, n: int) -> None:
    assert data.inputs.shape == (n, 1, 28, 28) and data.inputs.dtype == torch.float32
    assert data.targets.shape == (n,) and data.targets.dtype == torch.int64
    assert len(data) == n
    assert data.inputs.min() >= -1.0 and data.inputs.max() <= 1.0
    assert data.targets.min() >= 0 and data.targets.max() <= 9


# --- names, cache dir, containers -------------------------------------------------------------------------------


def test_unknown_name_lists_the_choices():
    with pytest.raises(ConfigError, match=r"unknown dataset 'cifar'; choose one of: digits, digits60k, mnist, random"):
        load_dataset("cifar")
    assert DATASET_NAMES == ("digits", "digits60k", "mnist", "random")


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "paratrain"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid under the XDG spec: ignored
    assert default_cache_dir() == Path.home() / ".cache" / "paratrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "paratrain"


def test_tensor_data_pairs_inputs_with_targets():
    data = TensorData(torch.zeros(4, 3), torch.arange(4))
    assert len(data) == 4
    moved = data.to("cpu")
    assert torch.equal(moved.inputs, data.inputs) and torch.equal(moved.targets, data.targets)
    with pytest.raises(ConfigError, match=r"inputs of shape \(4, 3\) and targets of shape \(5,\) do not pair up"):
        TensorData(torch.zeros(4, 3), torch.arange(5))
    with pytest.raises(ConfigError, match="targets \\(N,\\)"):
        TensorData(torch.zeros(4, 3), torch.zeros(4, 2))


# --- digits -----------------------------------------------------------------------------------------------------


def read_digits_csv() -> np.ndarray:
    path = Path(__file__).parents[1] / "src" / "paratrain" / "training" / "_assets" / "digits.csv.gz"
    return np.loadtxt(io.BytesIO(gzip.decompress(path.read_bytes())), delimiter=",", dtype=np.int64)


def test_digits_shapes_dtypes_and_range():
    splits = load_dataset("digits")
    assert isinstance(splits, DatasetSplits)
    assert (splits.name, splits.num_classes, splits.input_shape) == ("digits", 10, (1, 28, 28))
    assert_image_split(splits.train, 1437)
    assert_image_split(splits.test, 360)
    # blank background maps to -1 and full ink to +1, as ToTensor + Normalize((0.5,), (0.5,)) would
    assert splits.train.inputs.min() == -1.0 and splits.train.inputs.max() == 1.0
    assert set(splits.test.targets.tolist()) == set(range(10))


def test_digits_are_the_upsampled_asset_in_a_fixed_split():
    table = read_digits_csv()
    pixels = torch.from_numpy(table[:, :64]).float().view(-1, 1, 8, 8) / 16
    expected = (F.interpolate(pixels, size=(28, 28), mode="bilinear", align_corners=False) - 0.5) / 0.5
    labels = torch.from_numpy(table[:, 64])
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))
    splits = load_dataset("digits")
    torch.testing.assert_close(splits.train.inputs, expected[order[:1437]])
    torch.testing.assert_close(splits.test.inputs, expected[order[1437:]])
    assert torch.equal(splits.train.targets, labels[order[:1437]])
    assert torch.equal(splits.test.targets, labels[order[1437:]])
    assert load_dataset("digits") is splits  # cached in-process


# --- digits60k --------------------------------------------------------------------------------------------------


def test_digits60k_is_built_from_the_digits_train_split_only():
    digits = load_dataset("digits")
    big = load_dataset("digits60k")
    assert (big.name, big.num_classes, big.input_shape) == ("digits60k", 10, (1, 28, 28))
    assert_image_split(big.train, 60_000)
    assert big.test is digits.test  # the 360 real test images, untouched
    # by construction: the same augmentation applied to the train split alone, with a fixed seed; built afresh
    # here, so equality also shows every build is identical
    rebuilt = _augment(digits.train, 60_000, max_shift=2, noise_std=0.1, seed=0)
    assert torch.equal(rebuilt.inputs, big.train.inputs) and torch.equal(rebuilt.targets, big.train.targets)
    counts = torch.bincount(big.train.targets, minlength=10)
    assert counts.min() > 5_000  # every class well represented


def test_augment_copies_each_base_image_evenly_with_its_label():
    base = load_dataset("digits").train
    small = TensorData(base.inputs[:50], base.targets[:50])
    out = _augment(small, 120, max_shift=0, noise_std=0.0, seed=3)
    rows = {small.inputs[i].numpy().tobytes(): i for i in range(50)}
    sources = [rows[out.inputs[k].numpy().tobytes()] for k in range(120)]  # KeyError: not a base image
    assert [int(small.targets[s]) for s in sources] == out.targets.tolist()
    uses = np.bincount(sources, minlength=50)
    assert uses.min() == 2 and uses.max() == 3  # 120 over 50: each used 2 or 3 times


def test_augment_shifts_are_translations_of_base_images():
    base = load_dataset("digits").train
    small = TensorData(base.inputs[:20], base.targets[:20])
    out = _augment(small, 400, max_shift=2, noise_std=0.0, seed=1)
    padded = F.pad(small.inputs, (2, 2, 2, 2), value=-1.0)
    shifted = {
        padded[i, :, top : top + 28, left : left + 28].numpy().tobytes(): int(small.targets[i])
        for i in range(20)
        for top in range(5)
        for left in range(5)
    }
    for k in range(400):
        assert shifted[out.inputs[k].numpy().tobytes()] == int(out.targets[k])


def test_augment_uses_all_25_translations_and_adds_noise_of_the_given_size():
    flat = TensorData(torch.zeros(4, 1, 28, 28), torch.arange(4))  # mid-grey: the border shows the shift
    out = _augment(flat, 2000, max_shift=2, noise_std=0.0, seed=0)
    border_patterns = {tuple((img[0] == -1.0).nonzero().flatten().tolist()) for img in out.inputs}
    assert len(border_patterns) == 25
    noisy = _augment(flat, 200, max_shift=0, noise_std=0.1, seed=0).inputs
    assert abs(noisy.mean().item()) < 0.01 and abs(noisy.std().item() - 0.1) < 0.005
    again = _augment(flat, 200, max_shift=0, noise_std=0.1, seed=0).inputs
    assert torch.equal(noisy, again)


# --- random -----------------------------------------------------------------------------------------------------


def test_random_matches_the_first_seed():
    from paratrain.cli.demo import RandomDataset

    splits = load_dataset("random")
    assert (splits.name, splits.num_classes, splits.input_shape) == ("random", 2, (5,))
    for data in (splits.train, splits.test):
        assert data.inputs.shape == (100, 5) and data.inputs.dtype == torch.float32
        assert data.targets.dtype == torch.int64 and set(data.targets.tolist()) == {0, 1}
    assert not torch.equal(splits.train.inputs, splits.test.inputs)
    assert torch.equal(splits.train.inputs, RandomDataset(5, 100, torch.Generator().manual_seed(0)).data)
    again = load_dataset("random")
    assert torch.equal(again.test.inputs, splits.test.inputs) and torch.equal(again.test.targets, splits.test.targets)


# --- mnist: IDX files -------------------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    magic = (0x0800 | array.ndim) if magic is None else magic
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def fake_mnist(rng: np.random.Generator) -> dict[str, bytes]:
    """Small IDX files of MNIST's layout: 20 train and 10 test images with labels."""
    files = {}
    for prefix, n in (("train", 20), ("t10k", 10)):
        files[f"{prefix}-images-idx3-ubyte"] = idx_bytes(rng.integers(0, 256, (n, 28, 28)))
        files[f"{prefix}-labels-idx1-ubyte"] = idx_bytes(np.arange(n) % 10)
    return files


def write(directory: Path, files: dict[str, bytes], gzipped: set[str] = frozenset()) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name in gzipped:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)


def test_mnist_reads_plain_and_gzipped_idx_files(tmp_path):
    files = fake_mnist(np.random.default_rng(0))
    write(tmp_path, files, gzipped={"train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    splits = load_dataset("mnist", tmp_path, download=False, verify=False)
    assert (splits.name, splits.num_classes, splits.input_shape) == ("mnist", 10, (1, 28, 28))
    assert_image_split(splits.train, 20)
    assert_image_split(splits.test, 10)
    pixels = np.frombuffer(files["train-images-idx3-ubyte"], np.uint8, offset=16).reshape(20, 1, 28, 28)
    expected = (torch.from_numpy(pixels.copy()).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(splits.train.inputs, expected)
    assert splits.test.targets.tolist() == list(range(10))
    # the same files all gzipped give the same tensors
    write(tmp_path / "gz", files, gzipped=set(files))
    again = load_dataset("mnist", str(tmp_path / "gz"), download=False, verify=False)
    assert torch.equal(again.train.inputs, splits.train.inputs)


@pytest.mark.parametrize(
    "name, corrupt, message",
    [
        (
            "train-images-idx3-ubyte",
            lambda b: (0x0801).to_bytes(4, "big") + b[4:],
            r"magic number 0x00000801, expected",
        ),
        ("t10k-labels-idx1-ubyte", lambda b: b[:2], r"truncated: 2 bytes, too short for an IDX header"),
        ("train-images-idx3-ubyte", lambda b: b[:10], r"truncated: 10 bytes, but its 3-d IDX header needs 16"),
        ("train-images-idx3-ubyte", lambda b: b[:-5], r"truncated: its header gives shape \(20, 28, 28\)"),
        ("t10k-images-idx3-ubyte", lambda b: b + b"\0", r"longer than its header says"),
        ("train-labels-idx1-ubyte", lambda b: b[:-1] + b"\x0a", r"label 10 at index 19; MNIST labels are 0..9"),
        ("train-labels-idx1-ubyte", lambda b: idx_bytes(np.zeros(19)), r"holds 20 images but .* holds 19 labels"),
        ("t10k-images-idx3-ubyte", lambda b: idx_bytes(np.zeros((10, 27, 27))), r"images of 27x27 pixels"),
    ],
)
def test_corrupt_idx_files_are_named_with_the_problem(tmp_path, name, corrupt, message):
    files = fake_mnist(np.random.default_rng(1))
    files[name] = corrupt(files[name])
    write(tmp_path, files, gzipped={name})  # the corrupt one gzipped: the checks run after decompression
    with pytest.raises(DataError, match=message) as info:
        load_dataset("mnist", tmp_path, download=False, verify=False)
    assert f"{tmp_path / name}.gz" in str(info.value)
    assert "replace" in str(info.value).lower()


def test_a_broken_gzip_file_is_named(tmp_path):
    files = fake_mnist(np.random.default_rng(2))
    write(tmp_path, files)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"cannot read .*t10k-labels-idx1-ubyte\.gz.*delete it to download it again"):
        load_dataset("mnist", tmp_path, download=False, verify=False)


def test_missing_files_without_download_name_each_file_and_the_folder(tmp_path):
    files = fake_mnist(np.random.default_rng(3))
    write(tmp_path, {k: v for k, v in files.items() if k.startswith("train")})
    with pytest.raises(DataError) as info:
        load_dataset("mnist", tmp_path, download=False, verify=False)
    message = str(info.value)
    assert f"missing from {tmp_path}: t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (download=False)" in message
    assert "train-images" not in message
    assert "gzipped (name + '.gz') or plain" in message


# --- mnist: downloads -------------------------------------------------------------------------------------------


def test_an_unreachable_mirror_names_every_missing_file_and_where_to_put_them(tmp_path):
    target = tmp_path / "new" / "mnist"
    with pytest.raises(DataError) as info:
        _load_mnist(target, download=True, mirrors=UNREACHABLE, timeout=1.0)
    message = str(info.value)
    assert f"MNIST files missing from {target}: {', '.join(MNIST_FILES)}" in message
    assert "download failed: http://127.0.0.1:9/train-images-idx3-ubyte.gz:" in message
    assert "gzipped (name + '.gz') or plain" in message
    assert list(target.iterdir()) == []  # no partial downloads left behind


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # keep test output clean
        pass


@pytest.fixture
def http_dir(tmp_path) -> Iterator[tuple[Path, str]]:
    """A real HTTP server on 127.0.0.1 serving a folder: (folder, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_download_is_checked_then_moved_into_place(tmp_path, http_dir):
    served, url = http_dir
    files = fake_mnist(np.random.default_rng(4))
    write(served, files, gzipped=set(files))
    checksums = {f"{n}.gz": hashlib.md5((served / f"{n}.gz").read_bytes()).hexdigest() for n in files}
    target = tmp_path / "data"
    write(target, {"t10k-labels-idx1-ubyte": files["t10k-labels-idx1-ubyte"]})  # present files are kept
    # the first mirror refuses, the second serves
    splits = _load_mnist(
        target, download=True, verify=False, mirrors=(*UNREACHABLE, url), timeout=1.0, checksums=checksums
    )
    assert_image_split(splits.train, 20)
    assert sorted(p.name for p in target.iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte",
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
    ]


def test_a_checksum_mismatch_deletes_the_download(tmp_path, http_dir):
    served, url = http_dir
    files = fake_mnist(np.random.default_rng(5))
    write(served, files, gzipped=set(files))  # valid files, but not the real MNIST ones the checksums describe
    target = tmp_path / "data"
    with pytest.raises(DataError) as info:
        _load_mnist(target, download=True, mirrors=(url,), timeout=5.0)
    message = str(info.value)
    assert "train-images-idx3-ubyte.gz should have md5 f68b3c2dcbeaaa9fbdd348bbdeb94873" in message
    assert f"put the files in {target} yourself (gzipped or plain)" in message
    assert list(target.iterdir()) == []


def test_a_mirror_without_the_file_reports_the_http_error(tmp_path, http_dir):
    _, url = http_dir  # serves an empty folder: 404 for everything
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz: HTTP Error 404") as info:
        _load_mnist(tmp_path / "data", download=True, mirrors=(url,), timeout=5.0)
    assert ", ".join(MNIST_FILES) in str(info.value)


# --- mnist: files already on disk are checked like downloads --------------------------------------------------


def test_gzipped_files_on_disk_must_have_the_published_md5(tmp_path):
    """Random bytes with valid IDX headers, gzipped: refused, naming the file and both checksums."""
    write(tmp_path, fake_mnist(np.random.default_rng(5)), gzipped={"train-images-idx3-ubyte"})
    with pytest.raises(
        DataError,
        match=r"train-images-idx3-ubyte\.gz has md5 [0-9a-f]{32}, but MNIST's .* has md5 "
        r"f68b3c2dcbeaaa9fbdd348bbdeb94873: the file is damaged or another copy.*--no-verify-data",
    ):
        load_dataset("mnist", tmp_path, download=False)
    assert len(load_dataset("mnist", tmp_path, download=False, verify=False).train) == 20  # deliberately


def test_plain_files_on_disk_must_have_mnists_label_counts_and_brightness(tmp_path):
    files = fake_mnist(np.random.default_rng(6))
    write(tmp_path, files)
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte is not MNIST's train labels file: its label counts"):
        load_dataset("mnist", tmp_path, download=False)
    # labels with the release's counts, images of random bytes (mean brightness near 127.5): the images are named
    counts = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
    labels = np.repeat(np.arange(10), counts)
    images = np.random.default_rng(7).integers(0, 256, (60000, 28, 28))
    write(tmp_path, {"train-labels-idx1-ubyte": idx_bytes(labels), "train-images-idx3-ubyte": idx_bytes(images)})
    with pytest.raises(
        DataError,
        match=r"train-images-idx3-ubyte is not MNIST's train images file: 60000 images of "
        r"mean brightness 127\.\d\d, where MNIST has 60000 of 33\.32",
    ):
        load_dataset("mnist", tmp_path, download=False)


def test_the_train_command_says_how_to_use_another_copy(tmp_path):
    write(tmp_path, fake_mnist(np.random.default_rng(8)))
    failed = run_cli("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "1", "--quiet")
    assert (
        failed.returncode == 1 and "not MNIST's train labels file" in failed.stderr and "Traceback" not in failed.stderr
    )
    args = ("--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "1", "--quiet", "--batch-size", "10")
    assert run_cli("train", *args, "--no-verify-data", "--model", "mlp", "--width", "8").returncode == 0
