"""Gradient accumulation and global clipping through Parallel, against torch alone, under single, dp and ddp.

The oracle is :func:`accumulation_scenarios.plain`: torch on one device, the mean loss of each whole global batch.
Every run here cuts those global batches (10, 7, 10 and 5 samples) into micro-batches, unevenly, and must end
with the oracle's parameters; ddp runs in 2 gloo processes, where some ranks get empty micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import paratrain
from accumulation_scenarios import LR, data, ddp_modes, loop, plain
from ddp_scenarios import mlp
from paratrain.errors import ConfigError
from paratrain.loop.accumulation import micro_sizes
from processes import run_ranks

WORLD = 2


def _close(a: list[float], b: list[float], atol: float) -> float:
    diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
    assert diff <= atol, f"parameters differ by {diff:.3g} (allowed {atol:.3g})"
    return diff


@pytest.mark.parametrize(
    "local, total, steps, sizes",
    [
        (64, 64, 4, [16, 16, 16, 16]),
        (64, 64, 3, [22, 21, 21]),  # larger ones first, as split_sizes
        (29, 29, 4, [8, 7, 7, 7]),  # digits' last batch of an epoch
        (2, 3, 4, [1, 1, 0]),  # a global batch of 3: 3 micro-batches; this rank's 2 samples leave one empty
        (0, 1, 4, [0]),  # an empty share still takes part in the one micro-batch
        (5, None, 4, [2, 1, 1, 1]),  # global size unknown (a batch no prepared loader gave): exactly steps
    ],
)
def test_micro_batch_sizes(local, total, steps, sizes):
    assert micro_sizes(local, total, steps) == sizes


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu,cpu")])
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_accumulation_gives_the_whole_batch_gradient(strategy, devices, steps):
    expected = plain(clip=0.5)
    with paratrain.Parallel(strategy, devices) as par:
        found = loop(par, steps=steps, clip=0.5)
    _close(found["params"], expected["params"], atol=1e-5)
    # the clip norm is the whole batch's gradient norm, as torch computes it on one device
    assert found["norms"] == pytest.approx(expected["norms"], rel=1e-5)
    assert expected["params"] != plain()["params"]  # clipping changed the training, so it is tested too
    moved = (torch.tensor(expected["params"]) - torch.tensor(plain_initial())).abs().max().item()
    assert moved > 1e-2  # the runs trained, so agreeing means something


def plain_initial() -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in mlp().parameters()]).tolist()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return run_ranks(ddp_modes, WORLD, tmp_path_factory.mktemp("accumulate"), timeout=300)


@pytest.mark.processes
@pytest.mark.slow
def test_ddp_accumulation_equals_one_device(ddp_runs):
    expected = plain(clip=0.5)
    for found in ddp_runs:
        for name in ("fp32_k1", "fp32_k4"):
            _close(found[name]["params"], expected["params"], atol=1e-5)


@pytest.mark.processes
def test_ddp_accumulation_all_reduces_once_per_optimizer_step(ddp_runs):
    for found in ddp_runs:
        run = found["fp32_k4"]
        assert run["buckets"] >= 1
        # four micro-batches per step, one all-reduce per gradient bucket per step: one round
        assert run["all_reduce_calls"] == [run["buckets"]] * len(data())
        # the counter does see every round: four synchronising backwards make four
        assert found["synchronising_every_micro_batch"] == 4 * run["buckets"]


@pytest.mark.processes
def test_ddp_clip_norm_is_global_and_the_same_on_every_rank(ddp_runs):
    expected = plain(clip=0.5)["norms"]
    norms = [found["fp32_k4"]["norms"] for found in ddp_runs]
    assert all(n == norms[0] for n in norms)  # bit for bit: every rank holds the same synchronised gradient
    assert norms[0] == pytest.approx(expected, rel=1e-5)


# bfloat16 keeps 8 significant bits, so every value it rounds may move by 2^-8 of itself. Two strategies round
# different partial results (activations of different splits, per-rank partial gradients), so each step's update
# may differ by about 2^-8 of its size, and after the run the parameters by about 2^-8 of how far they moved
# in total; twice that covers two runs that each drift from the exact values. float16 keeps 11 bits: 2^-11.
# Anything wrong in the weighting or the synchronisation moves parameters by a sizeable part of the total.
def _tolerance(bits: int) -> float:
    movement = (torch.tensor(plain()["params"]) - torch.tensor(plain_initial())).abs().max().item()
    return 2 * 2.0**-bits * movement


@pytest.mark.processes
def test_bf16_mixed_agrees_across_single_dp_and_ddp(ddp_runs):
    tolerance = _tolerance(8)
    runs = {}
    for strategy, devices in (("single", "cpu"), ("dp", "cpu,cpu,cpu")):
        with paratrain.Parallel(strategy, devices, precision="bf16-mixed") as par:
            runs[strategy] = loop(par, steps=4)["params"]
    runs["ddp"] = ddp_runs[0]["bf16_k4"]["params"]
    assert all(found["bf16_k4"]["params"] == runs["ddp"] for found in ddp_runs)  # ranks hold the same model
    fp32 = plain()["params"]
    for name, params in runs.items():
        assert _close(params, fp32, tolerance) > 1e-6, f"{name}: no bfloat16 rounding at all: did autocast run?"
        for other in runs.values():
            _close(params, other, tolerance)


@pytest.mark.processes
def test_16_mixed_under_ddp_scales_unscales_and_clips_like_one_device(ddp_runs):
    expected = plain(clip=0.5)
    for found in ddp_runs:
        run = found["fp16_k4"]
        _close(run["params"], expected["params"], _tolerance(11))
        assert run["norms"] == pytest.approx(expected["norms"], rel=1e-3)  # unscaled before clipping
        assert run["applied"] == [True] * len(data()) and run["skipped_steps"] == 0


# --- misuse that would silently train on the wrong gradients ---------------------------------------------------


def _prepared(precision: str = "32"):
    par = paratrain.Parallel("single", "cpu", precision=precision)
    model = par.prepare(mlp())
    optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=LR))
    return par, model, optimizer, par.prepare(data())


def test_stepping_or_clipping_before_the_last_micro_batch_is_refused():
    par, model, optimizer, loader = _prepared()
    batch = next(iter(loader))
    for x, y in par.accumulate(model, batch, steps=4):
        par.backward(F.cross_entropy(model(x), y))
        break  # left after the first micro-batch: its gradient is local
    with pytest.raises(ConfigError, match=r"clip_grad_norm_\(\) after a backward inside no_sync"):
        par.clip_grad_norm_(model, 1.0)
    with pytest.raises(ConfigError, match=r"optimizer.step\(\) after a backward inside no_sync"):
        optimizer.step()
    with pytest.raises(ConfigError, match=r"step\(\) after a backward inside no_sync.*par.accumulate\(\) loop"):
        par.step(optimizer)
    par.backward(F.cross_entropy(model(batch[0]), batch[1]))  # a synchronising backward: stepping is fine again
    assert par.step(optimizer)
    par.close()


def test_accumulate_arguments_are_checked():
    par, model, _optimizer, loader = _prepared()
    batch = next(iter(loader))
    for steps in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="accumulate steps must be a positive int"):
            list(par.accumulate(model, batch, steps=steps))
    with pytest.raises(ConfigError, match="holds no tensor with a batch dimension"):
        list(par.accumulate(model, {"lr": 0.1}, steps=2))
    assert next(iter(par.accumulate(model, batch, steps=1))) is batch  # one micro-batch: the batch itself
    par.close()
