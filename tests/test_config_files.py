"""Settings files: ``--config FILE`` under the flags, ``--print-config``, and the Python API's from_file/to_toml."""

from __future__ import annotations

import json

import pytest
import tomllib

from conftest import run_main
from paratrain.errors import ConfigError
from paratrain.tools import BenchConfig, PlanConfig, VerifyConfig
from paratrain.training import TrainConfig

COMMANDS = {"train": TrainConfig, "verify": VerifyConfig, "bench": BenchConfig, "plan": PlanConfig}


def _printed(capsys, *args: str) -> dict:
    code, out, err = run_main(capsys, *args, "--print-config")
    assert code == 0, err
    return tomllib.loads(out)


@pytest.mark.parametrize("command", COMMANDS)
def test_the_command_line_overrides_the_file_and_the_file_the_defaults(capsys, tmp_path, command):
    path = tmp_path / "run.toml"
    path.write_text('batch-size = 32\nlr = 1\nseed = 7\nmodel = "mlp"\n')
    printed = _printed(capsys, command, "--config", str(path), "--lr", "0.5")
    assert printed["batch-size"] == 32 and printed["seed"] == 7 and printed["model"] == "mlp"  # the file's
    assert printed["lr"] == 0.5  # the command line's
    assert printed["accumulate"] == 1  # the default


@pytest.mark.parametrize("command", COMMANDS)
def test_a_printed_config_read_back_gives_the_same_settings(capsys, tmp_path, command):
    args = ["--batch-size", "48", "--optimizer", "adamw", "--betas", "0.8,0.95", "--precision", "bf16-mixed"]
    if command == "train":
        args += ["--devices", "cpu,cpu", "--log-dir", str(tmp_path / 'a "quoted" dir'), "--no-plot", "--quiet"]
    else:
        args += ["--configs", "single", "dp:cpu,cpu"]
    code, first, err = run_main(capsys, command, *args, "--print-config")
    assert code == 0, err
    saved = tmp_path / "printed.toml"
    saved.write_text(first)
    code, second, err = run_main(capsys, command, "--config", str(saved), "--print-config")
    assert code == 0, err
    assert second == first
    cls = COMMANDS[command]
    settings = cls.from_file(saved) if command != "train" else None
    if settings is not None:
        assert settings.betas == (0.8, 0.95) and settings.configs == ["single", "dp:cpu,cpu"]


def test_keys_take_dashes_or_underscores_but_not_both(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("batch_size = 16\nlog-every = 5\n")
    printed = _printed(capsys, "train", "--config", str(path))
    assert printed["batch-size"] == 16 and printed["log-every"] == 5
    path.write_text("batch_size = 16\nbatch-size = 32\n")
    code, _, err = run_main(capsys, "train", "--config", str(path))
    assert code == 2 and "sets 'batch-size' a second time" in err


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('batch-size = "64"', 'batch-size must be an integer; found "64" (a string)'),
        ("batch-size = 0", "batch-size must be at least 1; found 0"),
        ("epochs = 1.5", "epochs must be an integer"),
        ("lr = -1", "lr must be positive"),
        ('optimizer = "sgdd"', "optimizer must be one of: sgd, adamw"),
        ("betas = [0.9]", "betas must be a list of 2 numbers"),
        ("quiet = 1", "quiet must be true or false"),
        ("batch-sise = 64", "unknown setting 'batch-sise'; did you mean 'batch-size'?"),
        ("[train]\nlr = 1", "[train] is a table; settings files are flat"),
        ("lr = ", "not valid TOML"),
    ],
)
def test_a_bad_file_is_a_usage_error_naming_the_file_and_the_key(capsys, tmp_path, text, named):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    metrics = tmp_path / "m.json"
    code, out, err = run_main(capsys, "train", "--config", str(path), "--metrics-out", str(metrics))
    assert code == 2
    assert err.count("\n") == 1 and str(path) in err and named in err, err
    assert not metrics.exists() and "Training" not in out  # before anything started


def test_a_missing_file_is_a_usage_error(capsys, tmp_path):
    code, _, err = run_main(capsys, "bench", "--config", str(tmp_path / "none.toml"))
    assert code == 2 and "none.toml: cannot read it (No such file or directory)" in err


def test_a_run_uses_the_file(capsys, tmp_path):
    path = tmp_path / "run.toml"
    metrics = tmp_path / "m.json"
    path.write_text(f'max-steps = 2\nepochs = 1\nquiet = true\nmetrics-out = "{metrics}"\n')
    code, _, err = run_main(capsys, "train", "--config", str(path), "--batch-size", "16")
    assert code == 0, err
    result = json.loads(metrics.read_text())
    assert result["steps"] == 2 and result["batch_size"] == 16


def test_the_python_api_reads_and_writes_the_same_files(tmp_path):
    config = TrainConfig(lr=1e-5, devices="cpu,cpu", betas=(0.5, 0.25), optimizer="adamw", input_shape="3,8,8")
    config.data_dir = 'tab\there "quoted" back\\slash \x01 é'
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml(header="a run\nof two lines"))
    assert path.read_text().startswith("# a run\n# of two lines\n")
    assert TrainConfig.from_file(path) == config
    path.write_text("width = -1\n")
    with pytest.raises(ConfigError, match="width must be at least 1; found -1"):
        VerifyConfig.from_file(path)
