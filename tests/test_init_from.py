"""``paratrain train --init-from FILE``: a run that starts from weights in any format users have.

The oracle: a run of SGD at learning rate 1e-30 changes no float32 weight (each step moves a weight by far less
than half its last bit), so the checkpoint after its steps holds exactly the weights it started from: those of
the file, whatever its format, and not the seed's.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import run_main
from paratrain.checkpoint.file import latest_checkpoint
from paratrain.checkpoint.sharded import materialize, read_plain
from paratrain.errors import ConfigError
from paratrain.training import TrainConfig, train
from paratrain.training.model_spec import build_model_spec
from sharded_states import save_as

STILL = {"optimizer": "sgd", "lr": 1e-30, "max_steps": 2, "quiet": True}  # two steps that move no weight


def _net() -> torch.nn.Module:
    torch.manual_seed(7)  # not the run's seed (0): other weights than the run would start from
    return build_model_spec("simplenet", (1, 28, 28), 10, width=TrainConfig().width, depth=TrainConfig().depth)


def _misfit() -> dict[str, torch.Tensor]:
    """The weights of a net of 5 classes, not the digits' 10: its head has 5 rows."""
    weights = _net().state_dict()
    weights["fc2.weight"], weights["fc2.bias"] = weights["fc2.weight"][:5].clone(), weights["fc2.bias"][:5].clone()
    return weights


def _weights_after(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = materialize(read_plain(latest_checkpoint(directory)))["model"]
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _write(kind: str, weights: dict[str, torch.Tensor], tmp_path: Path) -> Path:
    if kind == "pt":
        torch.save(weights, tmp_path / "init.pt")
        return tmp_path / "init.pt"
    if kind == "ddp-prefixed":  # a DDP wrapper's state dict: every key under module.
        torch.save({f"module.{k}": v for k, v in weights.items()}, tmp_path / "ddp.pt")
        return tmp_path / "ddp.pt"
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(tmp_path / "init.safetensors"))
        return tmp_path / "init.safetensors"
    if kind == "dcp":  # as paratrain checkpoint export writes it: under "model"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        return tmp_path / "dcp"
    assert kind == "sharded"  # a paratrain checkpoint of 3 ranks
    return save_as(3, tmp_path / "run", {"model": weights, "epoch": 1})


@pytest.mark.parametrize("kind", ["pt", "ddp-prefixed", "safetensors", "dcp", "sharded"])
def test_a_run_starts_from_the_weights_of_every_format(tmp_path, kind):
    if kind == "safetensors":
        pytest.importorskip("safetensors")
    weights = _net().state_dict()
    source = _write(kind, weights, tmp_path)
    train(TrainConfig(init_from=str(source), checkpoint_dir=str(tmp_path / "ckpt"), **STILL))
    assert _same(_weights_after(tmp_path / "ckpt"), weights)


def test_dataparallel_over_two_cpu_replicas_starts_from_the_file_too(tmp_path):
    weights = _net().state_dict()
    source = _write("pt", weights, tmp_path)
    train(TrainConfig(strategy="dp", devices="cpu,cpu", init_from=str(source), checkpoint_dir="dp", **STILL))
    assert _same(_weights_after(Path("dp")), weights)


def test_the_command_starts_from_a_file_and_without_it_from_the_seed(tmp_path, capsys):
    weights = _net().state_dict()
    source = _write("pt", weights, tmp_path)
    flags = ["--optimizer", "sgd", "--lr", "1e-30", "--max-steps", "2", "--log-every", "100"]
    code, out, err = run_main(capsys, "train", *flags, "--init-from", str(source), "--checkpoint-dir", "a")
    assert code == 0, err
    assert out.splitlines()[0] == f"Starting from the weights in {source} (torch state dict, 4 tensors)"
    assert _same(_weights_after(Path("a")), weights)
    code, _, err = run_main(capsys, "train", *flags, "--checkpoint-dir", "b")
    assert code == 0, err
    assert not _same(_weights_after(Path("b")), weights)  # the seed's weights: the comparison above means something


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_weights_that_do_not_fit_are_refused_before_training_naming_the_first_difference(tmp_path, capsys):
    other = _write("pt", _misfit(), tmp_path)
    code, out, err = run_main(capsys, "train", "--init-from", str(other), "--checkpoint-dir", "c", "--max-steps", "1")
    hidden = _net().fc2.in_features
    assert code == 2 and err.splitlines() == [
        f"paratrain train: error: --init-from {other} does not fit the model: 'fc2.weight' has shape (5, {hidden}) "
        f"there, (10, {hidden}) in the model. Give weights of this model (the same --model, --width, --depth)"
    ]
    assert "Training" not in out and latest_checkpoint("c") is None
    partial = _net().state_dict()
    del partial["fc2.bias"]
    with pytest.raises(ConfigError, match=r"does not fit the model: it has no 'fc2.bias'; its keys begin"):
        train(TrainConfig(init_from=str(_write("pt", partial, tmp_path)), **STILL))


def test_a_checkpoint_to_resume_takes_precedence_over_init_from(tmp_path, capsys):
    source = _write("pt", _net().state_dict(), tmp_path)
    code, _, err = run_main(capsys, "train", "--init-from", "missing.pt")
    assert code == 2 and "--init-from missing.pt: nothing is there" in err
    # --resume if-exists: the file's weights while there is no checkpoint, the checkpoint's once there is one
    config = TrainConfig(init_from=str(source), checkpoint_dir="d", resume="if-exists", **STILL)
    assert train(config).resumed_from is None
    torch.save(_misfit(), source)  # would not fit: the checkpoint is read instead, the file not at all
    again = train(config)
    assert again.resumed_from is not None and again.start_step == 2
    # the run record's "continue it": its settings (init-from among them) and --resume
    capsys.readouterr()  # what the runs above printed
    flags = ["--optimizer", "sgd", "--lr", "1e-30", "--max-steps", "1", "--init-from", str(source)]
    code, out, err = run_main(capsys, "train", *flags, "--checkpoint-dir", "d", "--resume")
    assert code == 0, err
    assert f"Not reading --init-from {source}: the run continues its checkpoint d" in out.splitlines()[0]


@pytest.mark.processes
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero3", marks=pytest.mark.slow)])
def test_two_processes_start_from_a_safetensors_file(tmp_path, strategy):
    """ddp: each process loads the file into its plain model before prepare; zero3: each reads its shards of it
    into the model built on the meta device (tests/test_init_from_zero3.py)."""
    pytest.importorskip("safetensors")
    from processes import run_cli

    weights = _net().state_dict()
    source = _write("safetensors", weights, tmp_path)
    flags = ["--optimizer", "sgd", "--lr", "1e-30", "--max-steps", "2", "--quiet", "--init-from", str(source)]
    done = run_cli("train", "--strategy", strategy, "--nproc-per-node", "2", *flags, "--checkpoint-dir", "ckpt")
    assert done.returncode == 0, done.stderr
    assert _same(_weights_after(Path("ckpt")), weights)
