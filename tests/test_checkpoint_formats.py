"""Checkpoints in the formats users already have: safetensors (consolidate) and torch's DCP (export).

The oracle is the plain model and the plain AdamW a single process trains: a sharded checkpoint of theirs written
by 2 or 3 ranks (in this process, threads standing in for the ranks) must come out as files that
``safetensors.torch.load_file`` and ``torch.distributed.checkpoint.load`` read back into a fresh plain model (and
its optimizer's state by parameter name) with exactly the trained values.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import paratrain.checkpoint.formats as formats
from conftest import run_main
from paratrain.checkpoint.file import save_checkpoint
from paratrain.checkpoint.formats import safetensors_tensors
from paratrain.checkpoint.optimizer_names import optimizer_fqns
from paratrain.errors import CheckpointError
from sharded_states import save_as

safetensors_torch = pytest.importorskip("safetensors.torch")


class Tied(nn.Module):
    """An embedding tied to the output head, a buffer of no parameter's shape, and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 0.5))  # the root's buffer: first in the state dict
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mix(self.embed(x))) * self.scale.sum())


def _trained(make: type[nn.Module] = Tied, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.arange(7).roll(step)
        nn.functional.cross_entropy(model(x), torch.arange(7)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _checkpoint(tmp_path: Path, world: int, **extra: Any) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    model, optimizer = _trained()
    whole = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1, **extra}
    return model, optimizer, save_as(world, tmp_path / "run", whole)


# -- safetensors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_safetensors_from_a_sharded_checkpoint_loads_strictly_into_a_plain_model(tmp_path, capsys, world):
    model, _, path = _checkpoint(tmp_path, world)
    out = tmp_path / "model.safetensors"
    code, printed, err = run_main(capsys, "checkpoint", "consolidate", "--format", "safetensors", str(path), str(out))
    assert code == 0, err
    loaded = safetensors_torch.load_file(str(out))
    assert sorted(loaded) == sorted(model.state_dict())  # every key, the tied head's too
    fresh = Tied()
    fresh.load_state_dict(loaded)  # strict
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    assert fresh.head.weight is fresh.embed.weight  # still tied: both names filled the one parameter
    lines = printed.splitlines()
    assert lines[0] == f"wrote {out} (safetensors): the model state dict, 7 tensors, 87 elements"  # 3+28+16+4+4+4+28
    assert lines[1:] == [
        "  head.weight is the same tensor as embed.weight (a tied weight): written as a copy, which a strict "
        "load_state_dict takes (both names fill the one parameter)"
    ]


def test_a_non_contiguous_tensor_is_written_contiguous_and_other_values_are_refused(tmp_path, capsys):
    weight = torch.arange(12.0).reshape(3, 4)
    tensors, notes = safetensors_tensors({"w": weight.t(), "b": torch.ones(2)})
    assert tensors["w"].is_contiguous() and torch.equal(tensors["w"], weight.t())
    assert notes == ["w is not contiguous in memory: written as a contiguous copy (the same values)"]
    save_checkpoint({"model": {"w": weight.t(), "b": torch.ones(2)}}, tmp_path, "plain.pt")  # a file checkpoint
    out = tmp_path / "w.safetensors"
    code, printed, _ = run_main(
        capsys, "checkpoint", "consolidate", str(tmp_path / "plain.pt"), str(out), "--format", "safetensors"
    )
    assert code == 0 and "not contiguous" in printed
    assert torch.equal(safetensors_torch.load_file(str(out))["w"], weight.t())

    save_checkpoint({"model": {"w": weight, "norm._extra_state": {"version": 2}}}, tmp_path, "extra.pt")
    code, _, err = run_main(
        capsys, "checkpoint", "consolidate", str(tmp_path / "extra.pt"), "x.safetensors", "--format", "safetensors"
    )
    assert code == 2 and err.splitlines() == [
        "paratrain checkpoint: error: safetensors stores tensors only, and the model state has 1 other value(s) "
        "(dict) under ['norm._extra_state'] (a module's _extra_state, say): write it with --format torch, which "
        "keeps them"
    ]
    assert not Path("x.safetensors").exists()


def test_all_with_safetensors_and_safetensors_missing_are_usage_errors(tmp_path, capsys, monkeypatch):
    _, _, path = _checkpoint(tmp_path, 2)
    out = tmp_path / "all.safetensors"
    code, _, err = run_main(
        capsys, "checkpoint", "consolidate", str(path), str(out), "--all", "--format", "safetensors"
    )
    assert code == 2 and "--all with --format safetensors" in err and "--format torch" in err and not out.exists()

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        formats.importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else find_spec(name, *a)
    )
    code, printed, err = run_main(capsys, "checkpoint", "consolidate", str(path), str(out), "--format", "safetensors")
    assert (
        code == 2
        and printed == ""
        and err.splitlines()
        == [
            "paratrain checkpoint: error: --format safetensors needs the safetensors package, which is not installed: "
            "pip install 'paratrain[safetensors]'"
        ]
    )
    code, printed, _ = run_main(capsys, "checkpoint", "consolidate", str(path), str(tmp_path / "m.pt"))
    assert code == 0 and printed.startswith(f"wrote {tmp_path / 'm.pt'} (torch): the model state dict, 7 tensors")


# -- DCP ---------------------------------------------------------------------------------------------------------


def _load_dcp(template: dict[str, Any], path: Path) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    return template


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_export_reads_back_into_a_plain_model_and_its_adamw_by_name(tmp_path, capsys, world):
    model, optimizer, path = _checkpoint(tmp_path, world)
    out = tmp_path / "dcp"
    code, printed, err = run_main(capsys, "checkpoint", "export", "--format", "dcp", str(path), str(out))
    assert code == 0, err
    assert printed.splitlines() == [
        f"wrote {out} (dcp): model, optimizer, 22 tensors, 204 elements",  # 7 + 3 per parameter; 87 + 2 * 56 + 5
        "  the optimizer's state of 5 parameters, keyed by their names (as get_optimizer_state_dict)",
    ]
    fresh = Tied()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    template = {"model": fresh.state_dict(), "optimizer": get_optimizer_state_dict(fresh, fresh_optimizer)}
    loaded = _load_dcp(template, out)
    assert _same(loaded["model"], model.state_dict())
    expected = get_optimizer_state_dict(model, optimizer)  # torch's own layout of the trained AdamW, by name
    assert list(expected["state"]) == ["embed.weight", "mix.weight", "mix.bias", "norm.weight", "norm.bias"]
    assert _same(loaded["optimizer"], expected)
    assert float(loaded["optimizer"]["state"]["mix.bias"]["step"]) == 3.0

    code, _, _ = run_main(capsys, "checkpoint", "export", str(path), str(out), "--model-only")  # replaces it
    assert code == 0
    assert {key.split(".")[0] for key in dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata} == {
        "model"
    }
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, _, err = run_main(capsys, "checkpoint", "export", str(path), str(tmp_path / "other"))
    assert code == 2 and "holds other things than a DCP checkpoint" in err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


class WithNorm(nn.Module):
    """A BatchNorm's buffers beside parameters of their shape: the shapes alone cannot say which is which."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.fc(x.float().reshape(-1, 1).expand(-1, 3))))


def test_optimizer_names_come_from_the_record_or_a_placing_only_the_shapes_allow(tmp_path, capsys):
    model, optimizer = _trained(WithNorm)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with pytest.raises(
        CheckpointError,
        match=r"parameter 1 \(state of shape \(4,\)\) could be the model's 'fc.bias' or 'bn.bias': the checkpoint",
    ):
        optimizer_fqns(saved["model"], saved["optimizer"])
    names = [name for name, _ in model.named_parameters()]
    assert optimizer_fqns(saved["model"], saved["optimizer"], names) == names  # paratrain train records them
    named = torch.optim.AdamW(model.named_parameters())  # torch records them itself
    assert optimizer_fqns(saved["model"], named.state_dict()) == names

    path = save_as(2, tmp_path, {**saved, "epoch": 1})
    code, _, err = run_main(capsys, "checkpoint", "export", str(path), str(tmp_path / "dcp"))
    assert code == 1 and "--model-only" in err and not (tmp_path / "dcp").exists()
    recorded = save_as(3, tmp_path, {**saved, "epoch": 1, "parameter_names": names}, name="recorded")
    code, _, err = run_main(capsys, "checkpoint", "export", str(recorded), str(tmp_path / "dcp"))
    assert code == 0, err
    fresh = WithNorm()
    template = {"optimizer": get_optimizer_state_dict(fresh, torch.optim.AdamW(fresh.parameters()))}
    assert _same(
        _load_dcp(template, tmp_path / "dcp")["optimizer"]["state"], get_optimizer_state_dict(model, optimizer)["state"]
    )


@pytest.mark.processes
def test_the_real_command_writes_both_formats_from_a_3_rank_checkpoint(tmp_path):
    from processes import run_cli

    model, optimizer, path = _checkpoint(tmp_path, 3)
    done = run_cli("checkpoint", "consolidate", "--format", "safetensors", str(path), str(tmp_path / "m.safetensors"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'm.safetensors'} (safetensors): the model state dict, 7 tensors")
    fresh = Tied()
    fresh.load_state_dict(safetensors_torch.load_file(str(tmp_path / "m.safetensors")))
    assert _same(fresh.state_dict(), model.state_dict())
    done = run_cli("checkpoint", "export", "--format", "dcp", str(tmp_path / "run"), str(tmp_path / "dcp"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("paratrain checkpoint export: ") and "its latest checkpoint" in done.stderr
    template = {
        "model": Tied().state_dict(),
        "optimizer": get_optimizer_state_dict(fresh, torch.optim.AdamW(fresh.parameters())),
    }
    loaded = _load_dcp(template, tmp_path / "dcp")
    assert _same(loaded["model"], model.state_dict())
    assert _same(loaded["optimizer"], get_optimizer_state_dict(model, optimizer))
    done = run_cli("checkpoint", "export", "--format", "safetensors", str(path), str(tmp_path / "x"))
    assert done.returncode == 2 and "invalid choice: 'safetensors'" in done.stderr


def _fsdp2_loads(rank: int, world_size: int, exported: str, out: str) -> None:
    """An FSDP2 model (fully_shard, each of its modules a unit) at ``world_size`` reading the DCP directory, each
    rank its own shards; rank 0 writes the whole model and optimizer state it then holds, gathered."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)  # other weights than the checkpoint's
    model = Tied()
    for module in (model.mix, model.norm):
        fully_shard(module)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=exported)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = {
        "model": get_model_state_dict(model, options=whole),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=whole),
    }
    if rank == 0:
        torch.save(gathered, Path(out) / "gathered.pt")


@pytest.mark.processes
def test_an_fsdp2_model_at_another_world_size_reads_the_export(tmp_path, capsys):
    from processes import run_ranks

    model, optimizer, path = _checkpoint(tmp_path, 3)  # written by 3 ranks, read by 2
    code, _, err = run_main(capsys, "checkpoint", "export", str(path), str(tmp_path / "dcp"))
    assert code == 0, err
    run_ranks(_fsdp2_loads, 2, tmp_path, str(tmp_path / "dcp"), str(tmp_path), timeout=180)
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    assert _same(gathered["model"], model.state_dict())
    expected = get_optimizer_state_dict(model, optimizer)
    assert _same(gathered["optimizer"]["state"], expected["state"])
    assert [group["params"] for group in gathered["optimizer"]["param_groups"]] == [
        group["params"] for group in expected["param_groups"]
    ]
