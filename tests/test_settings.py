"""Every setting defined once: the commands share fields, not copies; each field carries its check."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from paratrain.errors import ConfigError
from paratrain.launch.launcher import LaunchConfig
from paratrain.settings import Settings, at_least, flag_of, one_of, setting
from paratrain.tools import BenchConfig, PlanConfig, VerifyConfig
from paratrain.training import TrainConfig

COMMANDS = {"train": TrainConfig, "verify": VerifyConfig, "bench": BenchConfig, "plan": PlanConfig}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_every_field_the_commands_share_has_one_default_one_help_and_one_check():
    shared = 0
    for (name_a, a), (name_b, b) in itertools.combinations(COMMANDS.items(), 2):
        fields_a, fields_b = _fields(a), _fields(b)
        for name in fields_a.keys() & fields_b.keys():
            fa, fb = fields_a[name], fields_b[name]
            where = f"{name!r} in {name_a} and {name_b}"
            assert fa.default == fb.default, f"{where}: defaults {fa.default!r} and {fb.default!r}"
            assert fa.metadata["help"] == fb.metadata["help"], f"{where}: two help texts"
            assert fa.metadata.get("check") is fb.metadata.get("check"), f"{where}: two checks"
            shared += 1
    # train and the tools share the model, data, optimizer, step and collective groups (and more between tools)
    assert set(_fields(TrainConfig)) & set(_fields(VerifyConfig)) >= {
        "model", "width", "depth", "dataset", "data_dir", "input_shape", "lr", "optimizer", "momentum",
        "batch_size", "accumulate", "precision", "clip_grad_norm", "seed", "timeout",
    }  # fmt: skip
    assert shared > 40


def test_different_meanings_have_different_names():
    """timeout is how long a collective waits everywhere; the tools' limit per configuration is run_timeout."""
    assert _fields(TrainConfig)["timeout"] is _fields(VerifyConfig)["timeout"]
    assert "run_timeout" in _fields(BenchConfig) and "run_timeout" not in _fields(TrainConfig)


def test_no_field_shadows_a_method():
    for cls in (*COMMANDS.values(), LaunchConfig):
        methods = {name for name in dir(cls) if callable(getattr(cls, name, None))}
        assert not methods & set(_fields(cls)), f"{cls.__name__}: {methods & set(_fields(cls))}"


@pytest.mark.parametrize("cls", [*COMMANDS.values(), LaunchConfig])
def test_every_field_has_help(cls):
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (TrainConfig, {"epochs": 0}, "--epochs must be at least 1; found 0"),
        (VerifyConfig, {"batch_size": 0}, "--batch-size must be at least 1; found 0"),
        (PlanConfig, {"lr": 1e39}, "--lr must be positive and below 3.4e+38; found 1e+39"),
        (BenchConfig, {"lr": 1e39}, "--lr must be positive and below 3.4e+38; found 1e+39"),
        (TrainConfig, {"optimizer": "lamb"}, "unknown optimizer 'lamb'; choose one of: sgd, adamw"),
        (BenchConfig, {"timeout": -1.0}, "--timeout must be a positive, finite number; found -1.0"),
        (TrainConfig, {"timeout": -1.0}, "--timeout must be a positive, finite number; found -1.0"),
        (BenchConfig, {"run_timeout": 0.0}, "--run-timeout must be positive seconds; found 0.0"),
    ],
)
def test_one_check_per_setting_the_same_for_every_command(cls, values, message):
    with pytest.raises(ConfigError) as info:
        cls(**values).check()
    assert message in str(info.value)


def test_group_rules_run_after_the_field_checks_base_groups_first():
    @dataclasses.dataclass
    class Inner(Settings):
        low: int = setting(1, "the low end", check=at_least(0))

        def check_group(self) -> None:
            order.append("inner")

    @dataclasses.dataclass
    class Outer(Inner):
        mode: str = setting("a", "a mode", check=one_of(("a", "b")))

        def check_group(self) -> None:
            order.append("outer")

    order: list[str] = []
    Outer().check()
    assert order == ["inner", "outer"]
    with pytest.raises(ConfigError, match="unknown mode 'c'; choose one of: a, b"):
        Outer(mode="c").check()
    assert flag_of("low") == "--low"


def test_from_dict_takes_json_values_back_and_refuses_unknown_keys():
    config = TrainConfig(optimizer="adamw", betas=(0.8, 0.9), epochs=2)
    again = TrainConfig.from_dict({**config.to_dict(), "betas": [0.8, 0.9]})
    assert again == config and again.betas == (0.8, 0.9)
    with pytest.raises(ConfigError, match=r"job.json: unknown setting\(s\) 'epoch'; TrainConfig takes"):
        TrainConfig.from_dict({"epoch": 3}, source="job.json")


def test_a_hang_report_goes_beside_the_runs_outputs_unless_asked_elsewhere(tmp_path):
    assert TrainConfig().hang_report_path() is None  # the current directory
    assert TrainConfig(metrics_out=str(tmp_path / "m.json")).hang_report_path() == str(tmp_path / "hang-report.json")
    assert TrainConfig(log_dir="logs", metrics_out="m.json").hang_report_path() == "logs/hang-report.json"
    both = TrainConfig(checkpoint_dir="ckpt", log_dir="logs")
    assert both.hang_report_path() == "ckpt/hang-report.json"
    assert TrainConfig(hang_report="h.json", checkpoint_dir="ckpt").hang_report_path() == "h.json"
