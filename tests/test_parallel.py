"""The Parallel API and strategy selection, with the loop written once for every strategy."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from conftest import run_main
from parallel_scenarios import (
    batched_loader_order,
    ddp_options_are_honoured,
    eval_loader_between_forward_and_backward,
    forgot_prepare,
    gather_pads_and_trims,
    plain_backward_and_prepare_twice,
    save_from_one_rank,
    train_job,
    unmatched_batch_warns_once,
    user_shuffle_order,
)
from paratrain.errors import ConfigError, DeviceError, ScatterError
from paratrain.strategies import (
    DataParallelStrategy,
    DistributedStrategy,
    SingleDevice,
    resolve_strategy,
    select_strategy,
)
from paratrain.training import TrainConfig, train
from paratrain.training.datasets import load_dataset
from paratrain.training.loader import DeviceLoader
from paratrain.training.models import SimpleNet
from processes import run_ranks


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
    for a, b in zip(results[0].parameters(), results[1].parameters(), strict=True):
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


# --- one rule for auto, and arguments that cannot be used ---------------------------------------------------


@pytest.mark.parametrize(
    "name, devices, gpus, launched, expected",
    [
        ("auto", "auto", 0, False, "single"),
        ("auto", "cpu", 0, False, "single"),
        ("auto", "cpu,cpu,cpu", 0, False, "dp"),
        ("auto", "auto", 0, True, "ddp"),
        ("auto", "cpu", 0, True, "ddp"),
        ("auto", "auto", 1, False, "single"),
        ("auto", "auto", 2, False, "ddp"),
        ("auto", "cuda", 2, False, "ddp"),
        ("auto", "auto", 2, True, "ddp"),
        ("dp", "cpu,cpu", 2, False, "dp"),
        ("single", "cpu", 2, True, "single"),
    ],
)
def test_auto_means_one_thing(monkeypatch, name, devices, gpus, launched, expected):
    """The rule behind Parallel("auto") and `paratrain train`; GPU counts are simulated (the rule is pure)."""
    import paratrain.strategies as strategies

    fake = [torch.device("cuda", i) for i in range(gpus)]
    monkeypatch.setattr(strategies, "visible_gpus", lambda: fake)
    monkeypatch.setattr(
        strategies,
        "resolve_devices",
        lambda d: fake if d in ("auto", "cuda") and fake else [torch.device("cpu")] * (d.count(",") + 1),
    )
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if launched:
            monkeypatch.setenv(variable, {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1"}.get(variable, "0"))
        else:
            monkeypatch.delenv(variable, raising=False)
    assert resolve_strategy(name, devices) == expected


def test_auto_choosing_ddp_outside_a_launcher_says_how_to_start(monkeypatch):
    import paratrain.strategies as strategies

    monkeypatch.setattr(strategies, "visible_gpus", lambda: [torch.device("cuda", 0), torch.device("cuda", 1)])
    with pytest.raises(ConfigError, match=r"chose ddp because 2 GPUs are visible.*paratrain launch.*strategy='dp'"):
        select_strategy("auto", "auto")


def test_a_strategy_object_with_devices_or_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"SingleDevice object.*devices='cpu,cpu'"):
        paratrain.Parallel(SingleDevice(torch.device("cpu")), devices="cpu,cpu")
    with pytest.raises(ConfigError, match=r"timeout=5"):
        paratrain.Parallel(SingleDevice(torch.device("cpu")), timeout=5)
    with pytest.raises(ConfigError, match="timeout is for strategy 'ddp'"):
        paratrain.Parallel("single", "cpu", timeout=5)
    paratrain.Parallel("auto", "cpu", timeout=5).close()  # auto may pick ddp elsewhere: the timeout is for then
    par = paratrain.Parallel(SingleDevice(torch.device("cpu")), devices="auto")
    assert par.strategy_name == "single" and par.describe() == "single on cpu"


# --- DDP's options through Parallel ---------------------------------------------------------------------------


def _no_hook(state, bucket):  # a hook never called: these strategies refuse it when they are built
    raise AssertionError("not called")


@pytest.mark.parametrize(
    "strategy, devices, option",
    [
        ("single", "cpu", {"find_unused_parameters": True}),
        ("dp", "cpu,cpu", {"static_graph": True}),
        ("dp", "cpu,cpu", {"bucket_cap_mb": 10}),
        ("single", "cpu", {"gradient_as_bucket_view": False}),
        ("dp", "cpu,cpu", {"comm_hook": _no_hook}),
    ],
)
def test_ddp_options_for_a_strategy_in_one_process_are_refused(strategy, devices, option):
    (name,) = option
    with pytest.raises(ConfigError, match=rf"DDP options apply to ddp and zero1.*strategy '{strategy}' with {name}="):
        paratrain.Parallel(strategy, devices, **option)
    with pytest.raises(ConfigError, match=rf"{name}=.*pass them to the strategy's constructor"):
        paratrain.Parallel(SingleDevice(torch.device("cpu")), **option)


def test_the_train_jobs_ddp_settings_reach_its_strategy():
    # train() itself (what each launched rank runs) hands them to Parallel, which refuses them for 'single'
    config = TrainConfig(strategy="single", devices="cpu", epochs=1, max_steps=1, quiet=True, static_graph=True)
    with pytest.raises(ConfigError, match="found strategy 'single' with static_graph=True"):
        train(config)


def test_auto_in_one_process_leaves_ddp_options_for_when_it_picks_ddp():
    with paratrain.Parallel("auto", "cpu", find_unused_parameters=True, bucket_cap_mb=5) as par:
        assert par.strategy_name == "single"


@pytest.mark.parametrize(
    "strategy, option, why",
    [
        ("zero1", {"gradient_as_bucket_view": False}, "its sharded optimizer reads"),
        ("zero2", {"gradient_as_bucket_view": False}, "keeps no whole gradient"),
        ("zero2", {"comm_hook": _no_hook}, "reduce-scattered, and a hook replaces an all-reduce; use strategy ddp"),
        ("zero3", {"comm_hook": _no_hook, "comm_state": object()}, "reduce-scattered unit by unit"),
        ("zero3", {"find_unused_parameters": True}, "no search for unused parameters"),
        ("zero3", {"static_graph": True}, "no bucket reducer"),
        ("zero3", {"bucket_cap_mb": 10}, r"unit by unit \(whole modules\), not in buckets; size the units"),
        ("zero3", {"gradient_as_bucket_view": False}, "keeps no whole gradient"),
    ],
)
def test_a_ddp_option_a_sharded_strategy_cannot_honour_is_refused_before_any_process_group(strategy, option, why):
    name = next(iter(option))
    # no launcher started this process: refused when the strategy is built, before setup() would say so
    with pytest.raises(ConfigError, match=rf"^{name}=\S+ is not supported under {strategy}: .*{why}"):
        paratrain.Parallel(strategy, "cpu", **option)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "option, expected",
    [
        ({"bucket_cap_mb": 0}, "must be positive; found 0"),
        ({"bucket_cap_mb": -1.5}, "must be positive; found -1.5"),
        ({"bucket_cap_mb": "25"}, "takes a number of MiB .*; found '25'"),
        ({"bucket_cap_mb": True}, "takes a number of MiB"),
        ({"bucket_cap_mb": float("inf")}, "takes a number of MiB"),
        ({"find_unused_parameters": "yes"}, "find_unused_parameters takes True or False; found 'yes' \\(str\\)"),
        ({"static_graph": 1}, "static_graph takes True or False"),
        ({"comm_hook": 3}, "comm_hook must be callable as hook\\(state, bucket\\); found int"),
        ({"comm_state": object()}, "no comm_hook was given.*pass comm_hook too, or drop comm_state"),
    ],
)
def test_bad_ddp_option_values_say_what_was_expected(option, expected):
    with pytest.raises(ConfigError, match=expected):
        paratrain.Parallel("ddp", "cpu", **option)
    with pytest.raises(ConfigError, match=expected):
        paratrain.DDPOptions(**option)


def test_ddp_takes_every_option_and_says_which_were_given():
    options = paratrain.DDPOptions(
        find_unused_parameters=True, static_graph=True, bucket_cap_mb=25, comm_hook=_no_hook, comm_state=None
    )
    assert options.given() == ["find_unused_parameters", "static_graph", "bucket_cap_mb", "comm_hook"]
    assert paratrain.DDPOptions().given() == []
    assert DistributedStrategy("cpu", options=options).options is options  # built: nothing refused


def test_launcher_flags_without_ddp_are_a_usage_error(capsys):
    code, _, err = run_main(capsys, "train", "--devices", "cpu,cpu", "--nproc-per-node", "2", "--epochs", "1")
    assert code == 2 and "Traceback" not in err
    assert "--nproc-per-node start processes for strategy ddp, but strategy 'auto' resolves to 'dp'" in err


def test_batch_tensors_that_disagree_on_size_are_named():
    par = paratrain.Parallel("single", "cpu")
    loader = par.prepare([(torch.zeros(10, 3), torch.zeros(9, dtype=torch.long))])
    with pytest.raises(ScatterError, match=r"batch\[0\]: 10, batch\[1\]: 9"):
        next(iter(loader))


# --- several processes ---------------------------------------------------------------------------------------


def _parallel_suite(rank: int, world: int, directory: str) -> dict:
    found = {
        scenario.__name__: scenario(rank, world)
        for scenario in (
            gather_pads_and_trims,
            user_shuffle_order,
            eval_loader_between_forward_and_backward,
            batched_loader_order,
            unmatched_batch_warns_once,
            forgot_prepare,
            plain_backward_and_prepare_twice,
            ddp_options_are_honoured,
        )
    }
    found["save_from_one_rank"] = save_from_one_rank(rank, world, directory)
    return found


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["world2", "world3"])
def parallel_suite(request, tmp_path_factory):
    world = request.param
    directory = tmp_path_factory.mktemp(f"parallel{world}")
    return world, run_ranks(_parallel_suite, world, directory, str(directory), timeout=240)


@pytest.mark.processes
def test_a_batch_no_loader_yielded_warns_once_while_several_loaders_are_alive(parallel_suite):
    _, ranks = parallel_suite
    for found in ranks:
        assert len(found["unmatched_batch_warns_once"]["warnings"]) == 1, found["unmatched_batch_warns_once"]


@pytest.mark.processes
def test_a_tensor_dataloader_is_indexed_under_ddp_in_one_process_order(parallel_suite):
    _, ranks = parallel_suite
    for found in ranks:
        r = found["batched_loader_order"]
        assert r["path"].startswith("indexed on cpu (a TensorDataset") and r["same_batches"], r
    assert ranks[0]["batched_loader_order"]["rng_as_one_process"]


@pytest.mark.processes
def test_gather_of_unequal_and_empty_parts(parallel_suite):
    world, ranks = parallel_suite
    ragged = [10.0 * r + i for r in range(world) for i in range(r + 1)]
    empty_on_last = [[r] * 3 for r in range(world - 1) for _ in range(2)]
    for found in (r["gather_pads_and_trims"] for r in ranks):
        assert found["ragged"] == ragged and found["ragged_dtype"] == "torch.float64"
        assert found["empty_on_last"] == empty_on_last
        assert found["scalar"] == [float(r) for r in range(world)]
        assert found["all_empty_shape"] == [0, 2]


@pytest.mark.processes
def test_a_users_shuffle_order_is_kept(parallel_suite):
    _world, ranks = parallel_suite
    expected = ranks[0]["user_shuffle_order"]["plain_expected"]
    for found in (r["user_shuffle_order"] for r in ranks):
        assert found["generator_batches"] and found["generator_kept"]
        assert found["plain_batches"] == expected  # every rank: the batches one process would see
        assert found["plain_generator_left_alone"] and found["rng_like_one_process"]
    assert expected[0] != expected[1]  # two epochs, two shuffles


@pytest.mark.processes
def test_an_eval_loader_does_not_change_the_training_weight(parallel_suite):
    for found in (r["eval_loader_between_forward_and_backward"] for r in parallel_suite[1]):
        assert found["vs_single"] < 1e-5


@pytest.mark.processes
def test_a_loss_from_a_model_no_one_prepared_is_refused_on_every_rank(parallel_suite):
    _, ranks = parallel_suite
    for found in ranks:
        assert "no model that par.prepare() returned has run forward" in found["forgot_prepare"]["error"]
        assert "under ddp every process would train its own copy" in found["forgot_prepare"]["error"]


@pytest.mark.processes
def test_ddp_options_given_to_parallel_are_honoured(parallel_suite):
    for found in (r["ddp_options_are_honoured"] for r in parallel_suite[1]):
        for strategy in ("ddp", "zero1", "zero2"):
            # a head no forward uses: trained as in one process, its gradient left None, under either option
            unused, static = found[f"{strategy} find_unused_parameters"], found[f"{strategy} static_graph"]
            assert unused["set"] == [True, False] and static["set"] == [False, True]
            for run in (unused, static):
                assert run["vs_single"] < 1e-6 and run["spare_untouched"], (strategy, run)
            assert found[f"{strategy} buckets"]["None"] == 1 and found[f"{strategy} buckets"]["0.0002"] > 2
        for strategy in ("ddp", "zero1"):
            hook = found[f"{strategy} hook"]
            assert hook["calls"] >= 5 and hook["vs_single"] < 1e-6, (strategy, hook)  # one bucket, five steps
        assert all(found["ddp grads are bucket views: True"]) and not any(found["ddp grads are bucket views: False"])


@pytest.mark.processes
def test_a_step_after_loss_backward_and_prepare_twice_are_refused_on_every_rank(parallel_suite):
    _, ranks = parallel_suite
    for found in ranks:
        cell = found["plain_backward_and_prepare_twice"]
        assert "Replace loss.backward() with par.backward(loss)" in cell["backward"], cell
        assert cell["unchanged_after_refusal"], cell
        for name in ("model", "prepared model", "optimizer", "loader"):
            assert "a second time" in cell[name] and "to prepare() once" in cell[name], (name, cell[name])
    assert len({found["plain_backward_and_prepare_twice"]["weight"] for found in ranks}) == 1


@pytest.mark.processes
def test_saving_from_the_main_process_alone_works_under_ddp_and_is_refused_at_once_under_zero2(parallel_suite):
    world, ranks = parallel_suite[0], [r["save_from_one_rank"] for r in parallel_suite[1]]
    weights = {strategy: {r[strategy]["trained on"] for r in ranks} for strategy in ("ddp", "zero2")}
    assert all(len(w) == 1 for w in weights.values()), weights  # every rank trained on, the same model
    for rank, found in enumerate(ranks):
        ddp, zero2 = found["ddp"], found["zero2"]
        main = rank == 0
        # ddp: rank 0 wrote alone, nobody waited in a collective; every rank's call returned with the file there
        if main:
            assert ddp["main alone"]["written"].endswith("main.pt"), ddp["main alone"]
        else:
            assert ddp["main alone"] == {"called": False}
        assert "error" not in ddp["every rank"] and ddp["there on return"]
        # the last rank alone: rank 0 writes ddp's file, and went on; refused as soon as rank 0's next collective shows
        if rank == world - 1:
            assert ddp["last rank alone"]["error"].startswith("ConfigError: par.save() is written by the main process")
            assert "call par.save(...) on every rank, or under `if par.is_main:`" in ddp["last rank alone"]["error"]
        else:
            assert ddp["last rank alone"] == {"called": False}
        # zero2: slices need every rank; the main process alone is refused (a ConfigError, not the 120 s timeout)
        if main:
            error = zero2["main alone"]["error"]
            assert error.startswith("ConfigError: par.save() under zero2 writes each process's own slices"), error
            assert "every rank must call it" in error and "not under `if par.is_main:`" in error
            assert "but rank 1 launched the group's collective #" in error
        assert "error" not in zero2["every rank"] and zero2["there on return"]


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu")])
def test_a_step_after_loss_backward_is_refused_with_the_fix(strategy, devices):
    """Under every strategy, so that a script that passes on one device fails the same way on many: the first
    optimizer.step() after a loss.backward() refuses, before any parameter moves."""
    with paratrain.Parallel(strategy, devices) as par:
        net = torch.nn.Linear(4, 2)
        model, optimizer = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        before = [p.detach().clone() for p in net.parameters()]
        optimizer.step()  # no gradient yet (a warm-up step before the loop, as some scripts do): nothing to refuse
        with torch.no_grad():
            model(torch.randn(3, 4))  # evaluation: no backward, nothing to refuse
        model(torch.randn(4, 4)).sum().backward()
        with pytest.raises(ConfigError, match=r"Replace loss.backward\(\) with par.backward\(loss\)"):
            optimizer.step()
        assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
        optimizer.zero_grad()
        for _ in range(2):  # the fix: every step follows a par.backward()
            par.backward(model(torch.randn(4, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
        assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))


@pytest.mark.parametrize("again", ["model", "returned model", "optimizer", "returned loader", "in one call"])
def test_prepare_twice_is_refused_naming_the_object(again):
    """Fabric: "A model should be passed only once"; a model wrapped twice cuts the batch twice under ddp."""
    with paratrain.Parallel("single", "cpu") as par:
        net = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        raw_loader = [torch.zeros(2, 4)]
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 4)), batch_size=2)
        model, optimizer, prepared_loader = par.prepare(net, optimizer, loader)
        given = {"model": (net,), "returned model": (model,), "optimizer": (optimizer,),
                 "returned loader": (prepared_loader,), "in one call": (torch.nn.Linear(1, 1),) * 2}[again]  # fmt: skip
        with pytest.raises(ConfigError, match=r"a second time .* to prepare\(\) once"):
            par.prepare(*given)
        par.prepare(loader, raw_loader)  # the raw loader again (an evaluation loader, say) is a new prepared one


def test_backward_without_a_prepared_model_says_to_prepare_it():
    with paratrain.Parallel("single", "cpu") as par:
        model = torch.nn.Linear(4, 2)
        with pytest.raises(ConfigError, match=r"Call model = par.prepare\(model\)"):
            par.backward(model(torch.randn(3, 4)).sum())
        prepared = par.prepare(model)  # the same loss through the prepared model is fine
        par.backward(prepared(torch.randn(3, 4)).sum())
        assert model.weight.grad is not None


def test_the_global_batch_note_gives_the_shares_and_the_batch_to_give():
    from paratrain.loop.prepared import global_batch_note

    data = TensorDataset(torch.zeros(10, 2))
    assert global_batch_note(DataLoader(data, batch_size=30), 4) == (
        "batch 30 is the global batch: 7 or 8 per process on 4 processes; for 30 per process give 120"
    )
    no_size = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    assert "each batch the loader yields is the global batch, cut into 2 shares" in global_batch_note(no_size, 2)
    # fewer samples than processes: some only wait, which the note says
    assert global_batch_note(DataLoader(data, batch_size=4), 6) == (
        "batch 4 is the global batch: 0 or 1 per process on 6 processes; for 4 per process give 24 (warning: global "
        "batch 4 on 6 processes: 2 of them get no samples each step (they only wait for the others), and the batch "
        "keeps at most 4 processes busy)"
    )


@pytest.mark.processes
@pytest.mark.slow
def test_empty_shares_leave_the_epoch_loss_finite(tmp_path):
    """718 samples a batch leave one sample in the last batch of digits' 1,437: ranks 1 and 2 get none."""
    settings = {"batch_size": 718, "epochs": 2}
    single = train(TrainConfig(quiet=True, **settings))
    ranks = run_ranks(train_job, 3, tmp_path, settings, timeout=240)
    for found in ranks:
        assert all(math.isfinite(loss) for loss in found["epoch_losses"])
        assert found["epoch_losses"] == pytest.approx(single.epoch_losses, abs=1e-6)
        assert found["test_accuracy"] == single.test_accuracy


def test_one_process_backward_needs_a_prepared_model_to_have_run_forward():
    """In one process the check costs one hook call: it removes itself after the first forward with autograd."""
    with paratrain.Parallel("single", "cpu") as par:
        model = par.prepare(nn.Linear(4, 2))
        x = torch.randn(3, 4)
        with torch.no_grad():
            model(x)  # evaluation does not count
        with pytest.raises(ConfigError, match=r"no model that par.prepare\(\) returned has run forward"):
            par.backward(nn.Linear(4, 2)(x).sum())
        par.backward(model(x).sum())
        assert not model._forward_pre_hooks  # gone after the first forward that counted
