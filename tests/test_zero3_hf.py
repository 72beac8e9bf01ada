"""zero3 on a Hugging Face GPT-2 built from a config, against our DDP, in two real processes over gloo.

Bit for bit at two ranks, the whole state dict after every step and an evaluation's logits: AdamW in nanoGPT's two
parameter groups (and SGD with momentum), fp32 and bf16-mixed, accumulation and clipping, the model's own loss
(``model(input_ids, labels=labels).loss``); zero3 in three layouts of units, and built inside ``par.init_module()``
(Hugging Face's ``post_init`` recorded on the meta device and replayed) from the weights a plain build has.
"""

from __future__ import annotations

import importlib.util

import pytest

from hf_gpt2_scenarios import CONFIGS, LAYOUTS, STEPS, two_ranks
from processes import run_ranks

if importlib.util.find_spec("transformers") is None:  # not imported here: the ranks import it
    pytest.skip("transformers is not installed (pip install -e '.[dev]')", allow_module_level=True)

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(two_ranks, 2, tmp_path_factory.mktemp("zero3hf"), timeout=600)


def test_the_model_is_hugging_faces_gpt2_in_the_trainers_parameter_groups(two):
    for rank in two:
        assert rank["keys"][0] == "transformer.wte.weight" and rank["keys"][-1] == "lm_head.weight"
        assert rank["groups_as_trainer"]  # nanoGPT's split by dimension is the Trainer's by name


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_zero3_trains_a_hugging_face_gpt2_bit_for_bit_as_ddp(two, config, layout):
    for rank in two:
        r = rank["exactness"][config]
        assert r["moved"] > 1e-3  # training changed the weights: the comparison means something
        assert r["clipped"]  # and clipping scaled the gradients where the configuration clips
        found = r[layout]
        assert found["bitwise"] == [True] * (STEPS + 1), found["bitwise"]  # the start, then after every step
        assert found["logits_bitwise"] == [True] * STEPS
        assert found["norms"] and found["tied"]


def test_the_layouts_cut_the_model_as_named(two):
    for rank in two:
        units = {layout: rank["exactness"]["adamw"][layout]["units"] for layout in LAYOUTS}
        assert units == {
            "default units": [""],  # each block is below the default policy's 65536 parameters
            "GPT2Block units": ["", "transformer.h.0", "transformer.h.1"],
            # the tied weight is the root's (lm_head there, wte in the transformer unit)
            "GPT2Model and GPT2Block units": ["", "transformer", "transformer.h.0", "transformer.h.1"],
        }


@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_built_inside_init_module_it_starts_from_a_plain_builds_weights_and_trains_as_ddp(two, layout):
    for rank in two:
        r = rank[f"init_module, {layout}"]
        assert r["on_meta"] and r["tied"]
        assert r["next_draw"]  # the generator left where a plain build leaves it
        # Hugging Face's _init_weights (post_init) replayed: the plain build's weights, then ddp's steps
        assert r["bitwise"] == [True] * (STEPS + 1), r["bitwise"]
        assert r["logits_bitwise"] == [True] * STEPS
