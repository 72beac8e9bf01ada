"""``--data module:callable``: the user's own splits as tensors or Datasets, and the errors a user can cause."""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from paratrain.errors import ConfigError
from paratrain.training import TrainConfig, train
from paratrain.training.user_data import load_user_data

TINY = ("--epochs", "1", "--batch-size", "16", "--quiet", "--model", "mlp", "--width", "8", "--depth", "1")


def test_tensors_train_from_the_command_line(capsys, tmp_path):
    metrics = tmp_path / "m.json"
    code, _, err = run_main(
        capsys, "train", *TINY, "--data", "data_for_tests:tensor_splits", "--metrics-out", str(metrics)
    )
    assert code == 0, err
    result = json.loads(metrics.read_text())
    assert result["dataset"] == "data_for_tests:tensor_splits"
    assert result["steps"] == 6 and result["samples"] == 96  # 96 samples in global batches of 16


@pytest.mark.parametrize("spec", ["data_for_tests:tensor_datasets", "data_for_tests:python_datasets"])
def test_every_form_of_the_same_data_trains_the_same_model(spec):
    """A TensorDataset and a Dataset built in Python hold the same samples as the tensors: the same run."""
    settings = {"epochs": 1, "batch_size": 16, "quiet": True, "model": "mlp", "width": 8, "depth": 1}
    plain = train(TrainConfig(data="data_for_tests:tensor_splits", **settings))
    other = train(TrainConfig(data=spec, **settings))
    assert other.model_fingerprint == plain.model_fingerprint


def test_the_splits_say_their_shape_and_classes():
    splits = load_user_data("data_for_tests:python_datasets")
    assert splits.input_shape == (6,) and splits.num_classes == 3
    assert len(splits.train) == 96 and len(splits.test) == 32
    assert splits.train.inputs.is_contiguous() and str(splits.train.targets.dtype) == "torch.int64"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("data_for_tests:raises", "raised FileNotFoundError: no such file: data/train.npy"),
        ("data_for_tests:one_split", "returned a Tensor; expected (train, test)"),
        ("data_for_tests:not_a_split", "the train split is a str; expected a pair of tensors"),
        ("data_for_tests:ragged", "near item 0 do not stack into a batch"),
        ("data_for_tests:shapes_differ", "train samples have shape (6,) but test samples (7,)"),
        ("data_for_tests:integer_inputs", "the train inputs are torch.uint8; give floating-point inputs"),
        ("data_for_tests:float_targets", "the train targets are torch.float32; give integer class indices"),
        ("data_for_tests:missing", "module 'data_for_tests' has no attribute 'missing'"),
        ("data_for_tests", "expected module.path:callable, such as mydata:splits"),
    ],
)
def test_bad_data_is_a_usage_error_with_the_reason(capsys, spec, reason):
    code, out, err = run_main(capsys, "train", *TINY, "--data", spec)
    assert code == 2
    assert err.startswith(f"paratrain train: error: --data {spec}") and reason in err, err
    assert "Training" not in out


def test_data_and_a_dataset_are_one_too_many():
    with pytest.raises(ConfigError, match="--data data_for_tests:tensor_splits and --dataset digits both say"):
        TrainConfig(data="data_for_tests:tensor_splits", dataset="digits").check()
