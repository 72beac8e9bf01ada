"""zero3 (fully sharded) against our DDP and one device, in real processes over gloo (world sizes 2 and 3).

Bitwise at two ranks for every configuration: an MLP, a nanoGPT-shaped model with tied weights in different units
and a frozen layer, BatchNorm buffers; SGD with momentum and AdamW, accumulation, clipping, bf16-mixed, prefetch
on and off; the state dict after every step and an evaluation under torch.no_grad(). At three ranks the
reduce-scatter adds the three ranks' gradients in another order than the all-reduce does: within ddp's own spread
(ddp with other buckets against ddp), which is 1e-6 relative for SGD and 8.9e-6 for AdamW.
A checkpoint written by three ranks resumes on two as zero3 and as ddp, the model as saved bit for bit.
"""

from __future__ import annotations

import pytest

from processes import run_ranks
from zero3_scenarios import CONFIGS, THREE_RANK_CONFIGS, three_ranks, two_ranks

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3checkpoints")


@pytest.fixture(scope="module")
def three(tmp_path_factory, checkpoints_dir):
    return run_ranks(three_ranks, 3, tmp_path_factory.mktemp("zero3x3"), str(checkpoints_dir), timeout=600)


@pytest.fixture(scope="module")
def two(tmp_path_factory, checkpoints_dir, three):  # after three: it resumes the three ranks' checkpoint
    return run_ranks(two_ranks, 2, tmp_path_factory.mktemp("zero3x2"), str(checkpoints_dir), timeout=600)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_train_bit_for_bit_as_ddp(two, config):
    for rank in two:
        r = rank["exactness"][config]
        assert r["moved"] > 1e-3 and r["finite"]  # training changed the weights: the comparison means something
        assert r["bitwise"], r
        assert r["outputs_bitwise"]  # the evaluation under torch.no_grad() after every step
        assert r["norms"]  # the clipping norm: the same float32 number as ddp's
        assert r["keys"] and r["user_keys"]  # the prepared model's state_dict: the user's keys, whole tensors


def test_three_ranks_sum_the_gradients_within_float32_rounding_of_ddp(three):
    for rank in three:
        r = rank["gradients"]
        # the unit buffers are cut at other places than ddp's buckets, so gloo's reduce-scatter adds some elements'
        # three terms in another order than ddp's all-reduce does: one rounding step apart, no more
        assert r["moved"] and r["rel"] < 1e-7, r


@pytest.mark.parametrize("config", THREE_RANK_CONFIGS)
def test_three_ranks_train_within_float32_rounding_of_ddp(three, config):
    for rank in three:
        r = rank["exactness"][config]
        # AdamW normalises each element's step: a gradient that nearly cancels across ranks (pure rounding) moves
        # its weight by up to lr * |g| / (|g| + eps) either way; SGD carries the rounding as it is. ddp itself, with
        # other buckets (the same sums in another order), spreads as far: zero3 stays within that spread
        assert r["bitwise"] or r["rel"] < 1e-6 or r["rel"] <= 2 * r["ddp_spread"], r
        assert r["rel"] < (1e-4 if "adamw" in config else 1e-6), r
        assert r["keys"] and r["user_keys"] and r["finite"]


def test_two_backwards_before_a_step_add_up(two):
    for rank in two:
        r = rank["two_backwards"]
        assert r["differs_from_one_backward"]  # ddp's second backward changed the step: there is a sum to check
        # the kept gradient is gathered back and autograd's added to it before dividing, as ddp adds into .grad
        assert r["bitwise"] and r["outputs_bitwise"], r
        assert r["with_no_sync"]["bitwise"], r["with_no_sync"]


def test_a_rank_holds_its_shards_and_parts_of_the_gradients(two):
    for rank in two:
        r = rank["memory"]
        assert r["units"] == ["", "2", "4"]  # the two large blocks; the root holds the small first and last layers
        assert r["unit_params"] == [4, 2, 2]
        assert r["gathered_after_backward"] == [False, False, False]
        assert r["storage_after_backward"] == [0, 0, 0]
        assert r["grad_parts"] == r["parts"]  # the reduced gradient: this rank's part of each unit
        assert r["whole_grads_gone"]  # each .grad a placeholder without storage: its use raises
        assert r["model_numel"] / 2 <= r["shard_numel"] < r["model_numel"] / 2 + 3 * 4
        assert r["params_keep_shape"] and r["params_refuse_reads"]  # between uses: the shapes; a read is refused
        # two moments of this rank's half of the elements (its parts less the padding that ends some of them)
        assert abs(r["optimizer_state"] - r["model_numel"]) <= 2 * 3 * 4
        assert r["gradients_whole"]  # par.gradients gathers them
        # prefetch 1, units root, "2", "4": once the first forward has shown the order, a forward gathers "2"
        # while the root's first layer computes and "4" while "2" does, and keeps "4" (the forward's last unit:
        # its backward is next); a backward starts at the root's output, which gathers the first unit not held
        # ("4" in the first backward, which "2" then follows; "2" in the next, "4" being kept)
        assert r["prefetched"] == [{"forward": 0, "backward": 2}, {"forward": 2, "backward": 3}]


def test_a_zero3_checkpoint_resumes_under_zero3_ddp_and_single_and_ddp_zero2_ones_under_zero3(two):
    for i, rank in enumerate(two):
        r = rank["checkpoints"]
        assert r["sharded"] and r["files"] == ["index.pt", "shard-00000.pt", "shard-00001.pt"]
        assert (r["zero3_written"] is not None) == (i == 0)
        for strategy in ("zero3", "ddp"):
            assert r[f"{strategy}_step"] == 2 and r[f"{strategy}_bitwise"], strategy
        assert r["single_rel"] < 1e-6  # one device sums the batch in another order
        assert r["from_ddp_bitwise"] and r["from_zero2_bitwise"]


def test_a_three_rank_checkpoint_resumes_on_three_ranks_and_in_one_process(three):
    for rank in three:
        r = rank["checkpoints"]
        assert r["files"] == ["index.pt", "shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
        assert r["zero3_bitwise"] and r["single_rel"] < 1e-6


def test_a_three_rank_checkpoint_resumes_on_two_as_zero3_and_ddp(two):
    for rank in two:
        r = rank["resume_elsewhere"]
        assert r["from"] == "zero3-3"
        assert r["zero3_loaded_bitwise"] and r["ddp_loaded_bitwise"]  # the model as the three ranks saved it
        assert r["zero3_is_ddp_bitwise"], r["zero3_ddp_rel"]  # and the two continue alike


def test_a_meta_model_is_materialised_as_a_plain_build_and_trains_as_ddp(two):
    for rank in two:
        r = rank["meta"]
        for name in ("mlp", "gpt", "bn"):
            assert r[f"{name}_equal"], name  # the weights a plain build with the same seed has
            assert r[f"{name}_tied"]
            assert r[f"{name}_trains_as_ddp"], name  # the optimizer built over the meta model steps the new weights
        # nanoGPT inside par.init_module(): zero3 replays its construction (apply(init) and all), ddp builds it
        assert r["nanogpt_zero3_on_meta"] and not r["nanogpt_ddp_on_meta"]
        for strategy in ("zero3", "ddp"):
            assert r[f"nanogpt_{strategy}_equal"] and r[f"nanogpt_{strategy}_next_draw"], strategy
        assert r["nanogpt_trains_as_ddp"]


def test_two_ranks_reduce_the_gradients_bit_for_bit_as_ddp(two):
    for rank in two:
        assert rank["gradients"]["bitwise"] and rank["gradients"]["moved"]


def test_torchs_own_utilities_on_zero3s_sharded_gradients_raise_naming_the_fix(two):
    for rank in two:
        found = rank["torch_utilities"]
        for use in (
            "torch clip_grad_norm_",
            "torch clip_grad_value_",
            "a hand-written norm",
            "an optimizer never prepared",
        ):
            assert "under zero3 no rank holds a parameter's whole gradient" in found[use], (use, found[use])
            assert found[f"{use}: trains on"]


def test_a_units_gradients_reduced_through_its_flat_buffer_train_bit_for_bit_as_ddp(two):
    for rank in two:
        r = rank["backwards"]
        # the MLP, and a view of cat's gradient, the clone of a transposed view, a frozen bias, the padding
        for name in ("mlp", "joined"):
            assert r[name]["bitwise"] and r[name]["outputs_bitwise"] and r[name]["finite"], (name, r[name])
            # accumulation: the no_sync backward keeps the whole gradient, the synchronising one adds to it
            accumulated = r[f"{name}, accumulate 2, clip"]
            assert accumulated["bitwise"] and accumulated["norms"], (name, accumulated)
