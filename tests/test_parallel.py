"""The Parallel API and strategy selection, with the loop written once for every strategy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.datasets import load_dataset
from paratrain.errors import ConfigError, DeviceError
from paratrain.loader import DeviceLoader
from paratrain.models import SimpleNet
from paratrain.strategies import DataParallelStrategy, SingleDevice, select_strategy


@pytest.mark.parametrize(
    "name, devices, kind, count",
    [
        ("auto", "auto", SingleDevice, 1),  # no GPU here: the CPU
        ("auto", "cpu", SingleDevice, 1),
        ("auto", "cpu,cpu,cpu", DataParallelStrategy, 3),
        ("dp", "cpu", DataParallelStrategy, 1),
        ("dp", "cpu,cpu", DataParallelStrategy, 2),
        ("single", "cpu", SingleDevice, 1),
    ],
)
def test_strategy_selection(name, devices, kind, count):
    if torch.cuda.is_available() and devices == "auto":
        pytest.skip("auto picks the GPUs here")
    strategy = select_strategy(name, devices)
    assert isinstance(strategy, kind)
    assert len(strategy.devices) == count


def test_strategy_errors_list_choices_and_explain():
    with pytest.raises(ConfigError, match=r"unknown strategy 'fast'; choose one of: auto, single, dp"):
        select_strategy("fast", "cpu")
    with pytest.raises(ConfigError, match=r"'single' runs on one device but 2 were given"):
        select_strategy("single", "cpu,cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device is visible"):
            select_strategy("auto", "cuda:0,cuda:1")


def _loop(par: paratrain.Parallel, model: nn.Module, loader, steps: int = 4) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    for _ in range(2):
        loader.set_epoch(0) if hasattr(loader, "set_epoch") else None
        for i, (x, y) in enumerate(loader):
            assert x.device == par.device
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            par.backward(loss)
            optimizer.step()
            if i + 1 == steps:
                break
    return par.unwrap(model)


@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu", "cpu,cpu,cpu"])
@pytest.mark.parametrize("loader_kind", ["device", "torch"])
def test_one_loop_any_strategy_same_parameters(devices, loader_kind):
    data = load_dataset("digits").train
    torch.manual_seed(0)
    base = SimpleNet()
    results = []
    for strategy in ("single", "auto"):
        par = paratrain.Parallel(strategy=strategy, devices="cpu" if strategy == "single" else devices)
        if loader_kind == "device":
            loader = DeviceLoader(data, 30, seed=3)
        else:
            g = torch.Generator().manual_seed(3)
            loader = DataLoader(TensorDataset(data.inputs, data.targets), batch_size=30, shuffle=True, generator=g)
        results.append(_loop(par, copy.deepcopy(base), loader))
        par.close()
    for a, b in zip(results[0].parameters(), results[1].parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert not torch.equal(next(base.parameters()), next(results[0].parameters()))


def test_prepare_returns_in_order_and_unwraps():
    par = paratrain.Parallel("dp", "cpu,cpu")
    model = SimpleNet()
    wrapped = par.prepare(model)
    assert isinstance(wrapped, paratrain.DataParallel)
    assert par.unwrap(wrapped) is model
    assert list(par.unwrap(wrapped).state_dict()) == list(model.state_dict())
    with pytest.raises(ConfigError, match="prepare\\(\\) takes models"):
        par.prepare(42)
    par.close()


def test_single_process_helpers_are_identities(capsys):
    par = paratrain.Parallel("single", "cpu")
    t = torch.tensor([1.0, 2.0])
    assert par.all_reduce(t) is t
    assert par.gather(t) is t
    assert par.is_main and par.rank == 0 and par.world_size == 1
    par.print("hello from main")
    par.barrier()
    assert "hello from main" in capsys.readouterr().out


def test_save_and_load_a_training_state(tmp_path):
    par = paratrain.Parallel("single", "cpu")
    model = SimpleNet()
    path = par.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "state.pt")
    assert path is not None and path.exists()
    state = par.load(tmp_path / "state.pt")
    assert state["epoch"] == 3
    torch.testing.assert_close(state["model"]["fc1.weight"], model.fc1.weight)
