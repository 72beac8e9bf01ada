"""check_fits: a model built for other inputs is one error naming the data's shape and the layer's expectation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_main
from paratrain.errors import ConfigError
from paratrain.training.fit import check_fits
from verify_models import wrong_channels, wrong_shape

IMAGES = (1, 28, 28)


def test_a_linear_layer_for_other_features_is_named_with_both_shapes():
    with pytest.raises(ConfigError) as caught:
        check_fits(wrong_shape(IMAGES, 10), torch.zeros(2, *IMAGES), input_shape=IMAGES, spec="m:wrong_shape")
    message = str(caught.value)
    assert "the dataset gives inputs of shape (1, 28, 28) per sample" in message
    assert "layer '1' (its first layer) expects 100 features per sample (Linear(100, 10))" in message
    assert "got a batch of shape (2, 784), 784 features per sample" in message


def test_a_convolution_for_other_channels_is_named():
    with pytest.raises(ConfigError, match=r"layer '0' \(its first layer\) expects 3 input channels"):
        check_fits(wrong_channels(IMAGES, 10), torch.zeros(2, *IMAGES), input_shape=IMAGES, spec="m:wrong_channels")


def test_on_the_meta_device_only_a_layer_of_the_wrong_size_is_reported():
    with torch.device("meta"):
        model = wrong_shape(IMAGES, 10)
    with pytest.raises(ConfigError, match="expects 100 features"):
        check_fits(model, torch.empty(2, *IMAGES, device="meta"), input_shape=IMAGES, spec="m", meta=True)

    class ReadsAValue(nn.Module):  # .item() has no meaning on meta tensors: left to the real run
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.sum().item()

    check_fits(ReadsAValue(), torch.empty(2, *IMAGES, device="meta"), input_shape=IMAGES, spec="m", meta=True)


def test_the_probe_leaves_the_model_and_the_random_stream_as_they_were():
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(2, *IMAGES)
    state = torch.get_rng_state()
    check_fits(model, sample, input_shape=IMAGES, spec="m")
    assert model.training and torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics too


def test_train_with_a_model_that_does_not_fit_is_one_usage_error_before_training(capsys):
    code, out, err = run_main(capsys, "train", "--model", "verify_models:wrong_shape", "--epochs", "1")
    assert code == 2 and "Epoch" not in out, out + err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "(1, 28, 28)" in err and "expects 100 features per sample" in err and "mat1 and mat2" not in err
