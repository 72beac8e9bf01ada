"""MNIST's IDX files: read plain or gzipped, damaged files named, downloads and files on disk checked."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_image_split
from paratrain.errors import DataError
from paratrain.training.datasets import load_dataset
from paratrain.training.mnist import load_mnist as _load_mnist
from processes import run_cli

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
UNREACHABLE = ("http://127.0.0.1:9/",)  # the discard port: nothing listens, the connection is refused at once


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


@pytest.mark.processes
@pytest.mark.slow
def test_the_train_command_says_how_to_use_another_copy(tmp_path):
    write(tmp_path, fake_mnist(np.random.default_rng(8)))
    failed = run_cli("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "1", "--quiet")
    assert (
        failed.returncode == 1 and "not MNIST's train labels file" in failed.stderr and "Traceback" not in failed.stderr
    )
    args = ("--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "1", "--quiet", "--batch-size", "10")
    assert run_cli("train", *args, "--no-verify-data", "--model", "mlp", "--width", "8").returncode == 0
