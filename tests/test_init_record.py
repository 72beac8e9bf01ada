"""A model's construction recorded on the meta device and replayed (paratrain.sharded.init_record), in one process:
the weights and the generator a plain build leaves, a tensor at a time, and zero3 at world size 1 from it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanogpt_shaped import NanoGPT
from paratrain.errors import ConfigError
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.sharded.init_record import _HF_PROBE, record_init


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _plain(build):
    torch.manual_seed(0)
    model = build()
    return model, torch.randn(5)  # the script's next draw


def _recorded(build):
    torch.manual_seed(0)
    with record_init() as record:
        model = build()
    return model, torch.randn(5), record


class _Padded(nn.Module):
    """A view written in place (Embedding's padding row), a buffer made by a factory, a weight copied from a
    tensor computed on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=3)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("table", torch.arange(6.0) * 0.5)
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 4) * 0.1 + torch.eye(4))


def test_a_replayed_nanogpt_has_the_plain_builds_weights_and_leaves_the_generator_where_it_does():
    plain, plain_next = _plain(NanoGPT)
    model, model_next, record = _recorded(NanoGPT)
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model_next, plain_next)  # the generator moved on as the plain build moved it
    values = {}
    record.replay(torch.device("cpu"), lambda key, flat: values.__setitem__(key, flat.clone()))
    assert len(values) == len(record.storages)
    # the init drew from the generator in the plain build's order: compare each parameter's final value
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        flat = values[int(q.untyped_storage()._cdata)]
        assert torch.equal(flat.as_strided(q.shape, q.stride(), q.storage_offset()), p.detach()), name


def test_views_buffers_and_copies_from_meta_tensors_are_replayed(group):
    plain, _ = _plain(_Padded)
    model, _, _ = _recorded(_Padded)
    net = FullyShardedDataParallel(model, min_params=1)
    assert _same(net.module.state_dict(), plain.state_dict())
    assert not plain.emb.weight[3].any()
    net.close()


def test_zero3_at_one_rank_materialises_a_recorded_nanogpt_as_the_plain_build(group):
    plain, _ = _plain(NanoGPT)
    model, _, _ = _recorded(NanoGPT)
    net = FullyShardedDataParallel(model, min_params=1000)
    assert _same(net.module.state_dict(), plain.state_dict())
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    net.close()


def test_a_replay_holds_a_tensor_or_two_at_a_time_not_the_model():
    def build() -> nn.Module:  # each layer's weights drawn twice: by its constructor, then by apply(init)
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
        model.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, nn.Linear) else None)
        return model

    _, _, record = _recorded(build)
    record.replay(torch.device("cpu"))
    layer = (256 * 256 + 256) * 4
    assert record.peak_bytes <= 2 * layer < 8 * layer, record.peak_bytes


def test_looking_at_the_weights_after_building_keeps_no_tensor_alive():
    def build() -> nn.Module:  # what scripts do after building: freeze, count, read shapes, take .data
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
        for p in model.parameters():
            p.requires_grad_(False)
            _ = p.data, p.shape, p.numel(), p[0]
        return model

    plain, _ = _plain(build)
    model, _, record = _recorded(build)
    values = {}
    record.replay(torch.device("cpu"), lambda key, flat: values.__setitem__(key, flat.clone()))
    assert record.peak_bytes <= 2 * (256 * 256 + 256) * 4, record.peak_bytes
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(values[int(q.untyped_storage()._cdata)].view_as(p), p)


def test_a_meta_tensor_made_before_the_block_is_refused_when_the_block_ends():
    with torch.device("meta"):
        outside = torch.empty(4, 4)
    with pytest.raises(ConfigError, match="did not make"), record_init():
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.add_(outside)


def test_a_hugging_face_gpt2s_post_init_is_recorded_and_replayed_a_tensor_at_a_time():
    pytest.importorskip("transformers")
    from hf_gpt2_scenarios import gpt2

    plain, plain_next = _plain(gpt2)
    model, model_next, record = _recorded(gpt2)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tie_weights ran on the meta model
    assert torch.equal(model_next, plain_next)  # _init_weights drew inside the block, as in the plain build
    values = {}
    record.replay(torch.device("cpu"), lambda key, flat: values.__setitem__(key, flat.clone()))
    for name, q in model.state_dict(keep_vars=True).items():
        flat = values[int(q.untyped_storage()._cdata)]
        assert torch.equal(flat.as_strided(q.shape, q.stride(), q.storage_offset()), plain.state_dict()[name]), name
    # its init runs under transformers' guard, which puts its own normal_ in torch.nn.init: still an overwrite, so
    # the constructor's draws are dropped before it (without that the replay held nearly the whole model)
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    assert record.peak_bytes <= 2 * largest, record.peak_bytes


def test_the_transformers_hack_still_applies():
    """init_record._transformers_init_runs answers Hugging Face's device probe while recording (the GPT-2 test
    above shows that this runs its init); if this fails after an upgrade of transformers, find how its init_weights
    now decides to skip on the meta device, and update the hack."""
    modeling_utils = pytest.importorskip("transformers.modeling_utils")
    probe = getattr(modeling_utils, _HF_PROBE)
    with torch.device("meta"):
        assert probe() == torch.device("meta")  # what makes PreTrainedModel.init_weights skip its initialisation
        with record_init():
            assert getattr(modeling_utils, _HF_PROBE)() is None  # a plain build's answer, while recording
    assert getattr(modeling_utils, _HF_PROBE) is probe
