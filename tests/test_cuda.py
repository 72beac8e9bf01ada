"""The CUDA paths: run on a machine with a GPU (scripts/gpu_check.py); skipped elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from conftest import assert_close_lists, grads_of
from paratrain import DataParallel
from paratrain.training.models import SimpleNet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _train(model, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(steps):
        x = torch.randn(30, 784, generator=g).cuda()
        y = torch.randint(0, 10, (30,), generator=g).cuda()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append(grads_of(model.module if isinstance(model, DataParallel) else model))
        opt.step()
    return grads


@pytest.mark.parametrize("replicas", [2, 3])
def test_cuda_repeated_device_replicas_match_one_gpu(replicas):
    torch.manual_seed(0)
    plain = SimpleNet().cuda()
    inner = copy.deepcopy(plain)
    dp = DataParallel(inner, device_ids=["cuda:0"] * replicas)
    assert dp._side_streams() is not None  # each replica on its own stream
    for a, b in zip(_train(plain), _train(dp), strict=True):
        assert_close_lists(a, b, atol=1e-5)
    assert_close_lists(list(plain.parameters()), list(inner.parameters()), atol=1e-5)


def test_cuda_output_device_cpu_and_autocast_reach_replicas():
    dp = DataParallel(SimpleNet().cuda(), device_ids=[0, 0], output_device=-1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dp(torch.randn(8, 784, device="cuda"))
    assert out.device.type == "cpu" and out.dtype == torch.bfloat16


def test_cuda_batchnorm_buffers_merge_across_streams():
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm1d(5).cuda()
    inner = copy.deepcopy(plain)
    dp = DataParallel(inner, device_ids=[0, 0])
    x = torch.randn(12, 5, device="cuda") * 3 + 1
    plain(x)
    dp(x)
    torch.testing.assert_close(inner.running_mean, plain.running_mean)
