"""paratrain verify: a clean model passes everywhere; each recognised cause of a difference is named.

Oracle style: every configuration is compared with single by verify itself; these tests check its verdicts on
models built to have (or not have) each cause, in real processes for ddp.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from paratrain.cli import main
from paratrain.errors import ConfigError
from paratrain.tools import VerifyConfig, verify
from processes import run_cli

TESTS = str(Path(__file__).parent)
SMALL = {"input_shape": "6", "num_classes": 3, "batch_size": 12, "steps": 2, "lr": 0.1}  # 12 = 6 + 6 = 4 + 4 + 4
GPU_DP = "dp:cuda:0,cuda:1"


def _with_tests_on_path() -> dict[str, str]:
    # ddp workers import the test models by name, like a user's module:callable
    return {"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}


def _verify(model: str, configs: list[str], **settings) -> dict:
    report = verify(VerifyConfig(model=f"verify_models:{model}", configs=configs, **{**SMALL, **settings}))
    return {v.config: v for v in report.verdicts} | {"report": report}


@pytest.fixture(scope="module")
def clean(monkeypatch_module):
    return _verify("clean_net", ["single", "dp:cpu,cpu", "dp:cpu,cpu,cpu", "ddp:2", GPU_DP])


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _with_tests_on_path().items():
            patch.setenv(name, value)
        yield patch


@pytest.mark.processes
def test_a_clean_model_passes_every_configuration_at_rounding_level(clean):
    for word in ("single", "dp:cpu,cpu", "dp:cpu,cpu,cpu", "ddp:2"):
        assert clean[word].status == "PASS", clean[word]
        assert max(clean[word].max_rel.values()) < 1e-5  # float rounding, not a real difference
    assert clean["single"].max_abs == {"loss": 0.0, "gradient": 0.0, "parameter": 0.0}
    assert clean["ddp:2"].max_abs["gradient"] > 0  # ddp really ran: its sums round differently
    report = clean["report"]
    assert report.ok is True and report.rtol == 1e-5
    assert "ddp:2" in report.render()


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can run dp over GPUs")
def test_a_configuration_this_machine_cannot_run_is_skipped_never_passed(clean):
    skipped = clean[GPU_DP]
    assert skipped.status == "SKIPPED" and skipped.reason == "no CUDA device is visible on this machine"
    assert "SKIPPED: no CUDA device is visible" in clean["report"].render()


@pytest.mark.processes
@pytest.mark.slow
def test_command_end_to_end_names_a_summed_loss_under_ddp(tmp_path):
    out = tmp_path / "verify.json"
    args = ["--model", "verify_models:clean_net", "--input-shape", "6", "--num-classes", "3", "--batch-size", "12"]
    configs = ["--configs", "single", "dp:cpu,cpu", "ddp:2", GPU_DP]
    result = run_cli(
        "verify", *args, *configs, "--steps", "2", "--loss", "sum", "--report-out", str(out), env=_with_tests_on_path()
    )
    assert result.returncode == 1, result.stdout + result.stderr  # a finding that fails the check
    report = json.loads(out.read_text())
    verdicts = {c["config"]: c for c in report["configs"]}
    # dp computes the loss on the gathered global batch, so a sum is the one device's sum
    assert verdicts["dp:cpu,cpu"]["status"] == "PASS"
    ddp = verdicts["ddp:2"]
    assert ddp["status"] == "FAIL" and [c["name"] for c in ddp["causes"]] == ["sum-loss"]
    assert "2.00 times smaller" in ddp["causes"][0]["found"] and "--loss sum" in ddp["causes"][0]["found"]
    assert ddp["first_divergence"]["step"] == 1 and ddp["first_divergence"]["quantity"] == "gradient"
    assert "likely cause (sum-loss)" in result.stdout and report["ok"] is False


def _causes(verdict) -> list[str]:
    return [c["name"] for c in verdict.causes]


def test_batchnorm_is_named_with_the_first_parameter_in_forward_order():
    result = _verify("batchnorm_net", ["single", "dp:cpu,cpu"])
    dp = result["dp:cpu,cpu"]
    assert dp.status == "FAIL" and _causes(dp) == ["batchnorm"]
    assert "norm" in dp.causes[0]["found"] and "SyncBatchNorm" in dp.causes[0]["advice"]
    # registered head, norm, body; forward runs body first: registration order would name head.weight
    assert dp.first_divergence["parameter"] == "body.weight"
    assert dp.first_divergence["step"] == 1 and dp.first_divergence["quantity"] == "gradient"
    assert result["report"].forward_order == [
        "body.weight",
        "body.bias",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "head.bias",
    ]
    rendered = result["report"].render()
    assert (
        "first divergence at step 1: gradient of 'body.weight'" in rendered and "likely cause (batchnorm)" in rendered
    )


def test_dropout_is_named():
    dp = _verify("dropout_net", ["single", "dp:cpu,cpu"])["dp:cpu,cpu"]
    assert dp.status == "FAIL" and _causes(dp) == ["dropout"]


def test_other_randomness_in_forward_is_named():
    dp = _verify("noisy_net", ["single", "dp:cpu,cpu,cpu"])["dp:cpu,cpu,cpu"]
    assert dp.status == "FAIL" and _causes(dp) == ["randomness"]


def test_non_determinism_is_named():
    dp = _verify("unseeded_net", ["single", "dp:cpu,cpu"])["dp:cpu,cpu"]
    assert dp.status == "FAIL" and _causes(dp) == ["nondeterminism"]


def test_a_configuration_that_fails_to_run_is_an_error_not_a_pass():
    result = _verify("picky_net", ["single", "dp:cpu,cpu"])
    dp = result["dp:cpu,cpu"]
    assert dp.status == "ERROR" and "PickyNet wants 12 samples, got 6" in dp.reason
    assert result["report"].ok is False and "ERROR: " in result["report"].render()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"optimizer": "lamb"}, "unknown optimizer 'lamb'; choose one of: sgd, adamw"),
        ({"precision": "8"}, "unknown precision '8'; choose one of: 32, bf16-mixed, 16-mixed"),
        ({"accumulate": 0}, "--accumulate must be at least 1"),
        ({"configs": ["dp:cpu"]}, "at least two devices"),
        ({"dataset": "digits", "input_shape": "6"}, "give one of them"),
        ({"input_shape": "3,x"}, "positive integers"),
        ({"steps": 0}, "--steps must be at least 1"),
    ],
)
def test_settings_no_run_can_use_are_usage_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        VerifyConfig(**settings).check()


def test_usage_error_exits_2_with_one_line(capsys):
    assert main(["verify", "--accumulate", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--accumulate must be at least 1" in err and "Traceback" not in err


def test_the_runs_optimizer_precision_and_accumulation_are_verified(monkeypatch_module):
    """AdamW, bf16-mixed and 3 micro-batches per step: dp agrees with single within bf16's tolerance."""
    result = _verify("clean_net", ["single", "dp:cpu,cpu"], optimizer="adamw", precision="bf16-mixed", accumulate=3)
    assert result["dp:cpu,cpu"].status == "PASS", result["report"].render()
    assert result["report"].rtol == 2e-2  # bf16's, not the float32 parameters'
    strict = _verify("clean_net", ["single", "dp:cpu,cpu"], accumulate=3)
    assert strict["dp:cpu,cpu"].status == "PASS" and strict["report"].rtol == 1e-5


# --- the rounding a configuration is entitled to: measured against single in float64, not one fixed tolerance ------


@pytest.mark.slow
@pytest.mark.processes
def test_clean_models_pass_under_adamw_and_bf16_where_a_fixed_tolerance_cried_wolf():
    """SimpleNet with AdamW: dp and ddp differ from single by 1e-4 relative (AdamW divides by the root of tiny
    squared gradients), rounding a float32 tolerance failed; under bf16-mixed ddp really computes in bf16."""
    configs = ["single", "dp:cpu,cpu", "ddp:2", "zero2:2", "zero3:2"]
    adamw = verify(VerifyConfig(optimizer="adamw", steps=3, configs=configs))
    assert adamw.ok, adamw.render()
    # zero2: no rank holds a whole gradient; verify gathers them, and they train as ddp's do
    assert adamw.verdict("zero2:2").status == "PASS" and adamw.verdict("zero2:2").max_abs["gradient"] > 0
    # zero3: no rank holds the whole weights either (verify gathers them too); at two ranks its steps are ddp's
    assert adamw.verdict("zero3:2").max_abs == adamw.verdict("ddp:2").max_abs
    assert adamw.tolerance.rule == "float64"
    assert adamw.verdict("dp:cpu,cpu").max_rel["parameter"] > 1e-5  # what the fixed float32 tolerance failed
    assert "within 16x single's own rounding" in adamw.render()
    bf16 = verify(VerifyConfig(precision="bf16-mixed", steps=3, configs=["single", "ddp:2"]))
    assert bf16.ok, bf16.render()
    # ddp's ranks compute in bf16 too: their gradients differ from single's by bf16's rounding, not float32's
    assert bf16.verdict("ddp:2").max_rel["gradient"] > 1e-3


@pytest.mark.slow
def test_a_clean_small_cnn_passes_under_dp_on_every_seed():
    for seed in range(3):
        settings = {"model": "verify_models:small_cnn", "seed": seed, "steps": 5}
        report = verify(VerifyConfig(**settings, configs=["single", "dp:cpu,cpu"]))
        assert report.ok, report.render()


def test_given_tolerances_compare_with_single_as_given():
    report = verify(VerifyConfig(optimizer="adamw", rtol=1e-5, steps=3, configs=["single", "dp:cpu,cpu"]))
    assert report.tolerance.rule == "fixed" and "--rtol/--atol given" in report.render()
    assert report.verdict("dp:cpu,cpu").status == "FAIL"  # AdamW's rounding is beyond 1e-5 of single
