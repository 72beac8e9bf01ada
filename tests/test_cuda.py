"""The CUDA paths: run on a machine with a GPU (scripts/gpu_check.py); skipped elsewhere."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_cuda_mixed_precision_through_parallel(precision, dtype):
    import paratrain

    torch.manual_seed(0)
    inner = SimpleNet()
    seen = []
    inner.fc1.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    with paratrain.Parallel("single", "cuda:0", precision=precision) as par:
        model = par.prepare(inner)
        optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        before = inner.fc1.weight.detach().clone()
        x = torch.randn(16, 784, device="cuda")
        out = model(x)
        par.backward(F.cross_entropy(out, torch.randint(0, 10, (16,), device="cuda")))
        norm = par.clip_grad_norm_(model, 100.0)
        applied = par.step(optimizer)
    assert seen == [dtype] and out.dtype == torch.float32
    assert torch.isfinite(norm) and applied and not torch.equal(before, inner.fc1.weight)


def test_cuda_step_timer_reads_events_only_when_flushed():
    from paratrain.training.timing import StepTimer

    timer = StepTimer(torch.device("cuda", 0))
    x = torch.randn(2048, 2048, device="cuda")
    for _ in timer.data(range(3)):
        x = x @ x / 2048
        timer.lap("forward")
        timer.lap("optimizer")
    timer.stop()
    assert timer.clock == "cuda events" and timer.totals["forward"] == 0.0  # nothing read yet
    timer.flush()
    assert timer.totals["forward"] > 0 and timer.steps == 3


def test_cuda_gradient_all_reduces_do_not_block_the_host_and_the_watchdog_ends_an_overdue_one(tmp_path):
    """nccl: the host goes on while an all-reduce waits behind GPU work; one overdue past timeout=2 s ends the
    process from the watchdog (exit 1, named on stderr), not when the GPU work ends 20 s later."""
    script = Path(__file__).parent / "scripts" / "cuda_watchdog.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    ended = time.time()
    stages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert stages and "host_seconds" in stages[0], done.stdout + done.stderr
    assert stages[0]["host_seconds"] < 0.5 * stages[0]["gpu_seconds"], stages[0]  # the host did not wait
    assert done.returncode == 1 and not any("survived" in s for s in stages), done.stdout + done.stderr
    assert "gradient all-reduce of bucket 0" in done.stderr and "did not complete within 2s" in done.stderr
    assert ended - stages[1]["stalled_at"] < 10, "the watchdog ended the process only when the GPU work did"


def test_cuda_data_parallel_device_objects_output_device_and_keyword_only_input():
    """torch's test_data_parallel_device_args and _module_kwargs_only_empty_list, on one GPU used twice."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(10, 5)

        def forward(self, input):
            return self.layer(input["data"])

    net = Net().cuda()
    x = torch.randn(20, 10, device="cuda")
    cuda0 = torch.device("cuda:0")
    dp = DataParallel(net, device_ids=[cuda0, cuda0], output_device=cuda0)
    out = dp(input={"data": x, "unused": []})
    assert out.device == cuda0
    torch.testing.assert_close(out, net.layer(x))


@pytest.fixture
def one_rank_nccl():
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_cuda_ddp_on_the_gpu_trains_like_one_gpu_after_a_pickle_round_trip(one_rank_nccl, tmp_path):
    """torch's _test_DistributedDataParallel on one GPU: device_ids, CPU inputs moved over, torch.save of the
    wrapper, and backward(create_graph=True)."""
    from paratrain import DistributedDataParallel

    torch.manual_seed(0)
    plain = SimpleNet().cuda()
    ddp = DistributedDataParallel(copy.deepcopy(plain), device_ids=[0], gradient_as_bucket_view=True)
    torch.save(ddp, tmp_path / "ddp.pt")
    ddp.close()
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=False)
    assert ddp.output_device == torch.device("cuda:0")
    g = torch.Generator().manual_seed(1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)
        for model, opt, inputs in ((plain, opt_plain, (x.cuda(), y.cuda())), (ddp, opt_ddp, (x, y.cuda()))):
            opt.zero_grad()
            F.cross_entropy(model(inputs[0]), inputs[1]).backward(create_graph=model is ddp)
            opt.step()
    assert_close_lists(list(plain.parameters()), list(ddp.module.parameters()), atol=1e-5)
    ddp.close()


def test_cuda_log_line_says_allocated_and_reserved_memory_and_mfu_where_the_peak_is_known(tmp_path):
    from paratrain.training import TrainConfig, train
    from paratrain.training.flops import peak_flops

    lines: list[str] = []
    result = train(
        TrainConfig(epochs=1, max_steps=3, log_every=1, devices="cuda", precision="bf16-mixed"), log=lines.append
    )
    logged = [line for line in lines if line.startswith("Epoch 0, Step ")]
    assert logged and all(" MiB allocated / reserved" in line and "rss" not in line for line in logged)
    entry = result.logged_steps[-1]
    assert entry["memory/allocated_mib"] > 0 and entry["memory/reserved_mib"] >= entry["memory/allocated_mib"]
    known = peak_flops(torch.device("cuda:0"), "bf16-mixed") is not None
    assert all(("| mfu " in line) == known for line in logged)  # MFU only where the GPU's peak is known
    assert ("train/mfu" in entry) == known and entry["train/flops_per_s"] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_zero_stages_on_one_nccl_rank_train_like_the_plain_model(one_rank_nccl, stage):
    """zero1, zero2 and zero3 on the GPU over NCCL (the watchdog path: the host does not wait), with AdamW and
    clipping: the same weights as the plain model (one rank: every shard is the whole); the peak allocated is
    printed for the device check's log."""
    from paratrain.sharded.fully_sharded import FullyShardedDataParallel
    from paratrain.sharded.optimizer import shard_optimizer
    from paratrain.sharded.zero import ZeroDataParallel

    torch.manual_seed(0)
    plain = SimpleNet().cuda()
    net = copy.deepcopy(plain)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    wrapped = FullyShardedDataParallel(net, min_params=1) if stage == 3 else ZeroDataParallel(net, stage=stage)
    opt = shard_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3), wrapped)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 784, generator=g).cuda(), torch.randint(0, 10, (16,), generator=g).cuda()
        F.cross_entropy(plain(x), y).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        opt_plain.step()
        opt_plain.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        wrapped.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    state = wrapped.module.state_dict()
    for name, p in plain.named_parameters():
        assert torch.allclose(state[name], p.detach(), atol=1e-6), name
    peak = torch.cuda.max_memory_allocated()
    print(f"zero{stage} on one GPU: peak {peak / 2**20:.1f} MiB")
    wrapped.close()
