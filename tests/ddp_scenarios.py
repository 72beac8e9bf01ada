"""What each rank runs in the DistributedDataParallel tests; every function returns JSON-able findings."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paratrain.ddp.comm_hooks import bf16_compress_hook, fp16_compress_hook
from paratrain.ddp.distributed import DistributedDataParallel as DDP
from paratrain.dp.scatter_gather import shard
from paratrain.errors import DistributedError

BATCH = 10  # over 3 ranks: slices of 4, 3, 3


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(steps)]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x.detach() - y.detach()).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.state_dict().values() if p.is_floating_point()))


def sharded_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's mean loss on its share, weighted by the share: the average over ranks is the whole batch's mean."""
    mine = shard(torch.arange(len(x)), rank, world)
    return F.cross_entropy(model(x[mine]), y[mine]) * (len(mine) * world / len(x))


def _train_sharded(model: nn.Module, rank: int, world: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(steps):
        opt.zero_grad()
        sharded_loss(model, x, y, rank, world).backward()
        opt.step()


def _train_whole(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def equals_single_and_torch(rank: int, world: int) -> dict[str, Any]:
    """5 steps of ours and of torch's DDP on uneven slices, against one process on the whole batch."""
    reference = mlp()
    ours_inner = mlp(seed=100 + rank)  # different on purpose: start-up must broadcast rank 0's values...
    ours_inner.load_state_dict(reference.state_dict()) if rank == 0 else None
    ours = DDP(ours_inner, bucket_cap_mb=0.0002, timeout=30)  # several small buckets (three)
    started_equal = max_diff(ours_inner, reference)
    torch_ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(reference))
    _train_sharded(ours, rank, world, 5)
    _train_sharded(torch_ddp, rank, world, 5)
    _train_whole(reference, 5)
    return {
        "started_equal": started_equal,
        "vs_single": max_diff(ours_inner, reference),
        "vs_torch": max_diff(ours_inner, torch_ddp.module),
        "moved": max_diff(reference, mlp()),
        "buckets": len(ours.reducer.buckets),
    }


def gradient_as_bucket_view(rank: int, world: int) -> dict[str, Any]:
    reference = mlp()
    inner = mlp()
    ddp = DDP(inner, gradient_as_bucket_view=True, timeout=30)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(4):
        opt.zero_grad(set_to_none=False)
        sharded_loss(ddp, x, y, rank, world).backward()
        opt.step()
    _train_whole(reference, 4)
    buffer = ddp.reducer.collective.buffers[0]
    p = next(iter(ddp.reducer.params))
    in_bucket = p.grad is not None and p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return {"vs_single": max_diff(inner, reference), "grad_in_bucket": in_bucket}


def no_sync_accumulates(rank: int, world: int) -> dict[str, Any]:
    """Two micro-batches under no_sync plus one synchronised: the same as one big batch."""
    reference = mlp()
    inner = mlp()
    ddp = DDP(inner, timeout=30)
    data = batches(3, seed=5)
    for i, (x, y) in enumerate(data):
        mine = shard(torch.arange(BATCH), rank, world)
        loss = F.cross_entropy(ddp(x[mine]), y[mine], reduction="sum") / (BATCH * len(data)) * world
        if i < len(data) - 1:
            with ddp.no_sync():
                loss.backward()
            local_only = inner[0].weight.grad.clone()
        else:
            loss.backward()
    x_all = torch.cat([x for x, _ in data])
    y_all = torch.cat([y for _, y in data])
    F.cross_entropy(reference(x_all), y_all).backward()
    grads = [
        (a.grad - b.grad).abs().max().item() for a, b in zip(inner.parameters(), reference.parameters(), strict=True)
    ]
    differs_locally = not torch.allclose(local_only, reference[0].weight.grad)
    return {"grad_diff": max(grads), "local_differs_before_sync": differs_locally}


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 3)
        self.never = nn.Linear(4, 3)
        self.rank0_only = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out = self.used(x)
        return out + self.rank0_only(x) if rank == 0 else out


def unused_parameters(rank: int, world: int) -> dict[str, Any]:
    x = torch.ones(2, 4) * (rank + 1)
    model = Branchy()
    ddp = DDP(model, find_unused_parameters=True, timeout=30)
    ddp(x, rank).sum().backward()
    expected_rank0_only = Branchy().rank0_only
    (expected_rank0_only(torch.ones(2, 4))).sum().backward()  # rank 0's gradient, then averaged over ranks
    found = {
        "never_is_none": model.never.weight.grad is None and model.never.bias.grad is None,
        "rank0_only_diff": (model.rank0_only.weight.grad - expected_rank0_only.weight.grad / world).abs().max().item(),
        "used_grad": model.used.bias.grad.tolist(),
    }
    strict = DDP(Branchy(), timeout=30)
    try:
        strict(x, 0).sum().backward()  # every rank skips `never`
        found["strict_error"] = None
    except DistributedError as exc:
        found["strict_error"] = str(exc)
    return found


def comm_hooks(rank: int, world: int) -> dict[str, Any]:
    """100 steps with fp16 and bf16 compression against plain all-reduce."""
    models = {name: DDP(mlp(), timeout=30) for name in ("plain", "fp16", "bf16")}
    models["fp16"].register_comm_hook(None, fp16_compress_hook)
    models["bf16"].register_comm_hook(None, bf16_compress_hook)
    for model in models.values():
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(3)
        for _ in range(100):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
            mine = shard(torch.arange(8), rank, world)
            opt.zero_grad()
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
    plain = models["plain"].module
    scale = max(p.abs().max().item() for p in plain.parameters())
    return {name: max_diff(models[name].module, plain) / scale for name in ("fp16", "bf16")}


def startup_mismatch(rank: int, world: int) -> str:
    model = nn.Sequential(nn.Linear(4, 5 if rank != 1 else 6))
    try:
        DDP(model, timeout=30)
    except DistributedError as exc:
        return str(exc)
    return "no error"


def buffers_and_state_dict(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # different values everywhere before wrapping
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    ddp = DDP(model, timeout=30)
    after_start = checksum(model)
    model[1].running_mean.fill_(float(rank) + 10)  # diverge again; the next forward re-broadcasts
    ddp.eval()
    with torch.no_grad():
        ddp(torch.randn(3, 4))
    keys = list(ddp.state_dict())
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain.load_state_dict({k.removeprefix("module."): v for k, v in ddp.state_dict().items()})
    return {
        "after_start": after_start,
        "running_mean": model[1].running_mean.tolist(),
        "keys": keys,
        "round_trip": max_diff(plain, model) == 0.0,
    }


def join_uneven(rank: int, world: int) -> dict[str, Any]:
    """Rank r has 2 + 2r batches; everyone finishes; the longest rank matches a replay of the averaged steps."""
    steps = [2 + 2 * r for r in range(world)]
    data = batches(max(steps), seed=9)
    model = mlp()
    ddp = DDP(model, timeout=30)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    done = 0
    with ddp.join():
        for x, y in data[: steps[rank]]:
            mine = shard(torch.arange(BATCH), rank, world)
            opt.zero_grad()
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            opt.step()
            done += 1
    # replay: at step t, the averaged gradient is the sum over ranks still active, divided by world
    replay = mlp()
    opt_r = torch.optim.SGD(replay.parameters(), lr=0.1)
    for t, (x, y) in enumerate(data[: max(steps)]):
        opt_r.zero_grad()
        for r in range(world):
            if t < steps[r]:
                mine = shard(torch.arange(BATCH), r, world)
                (F.cross_entropy(replay(x[mine]), y[mine]) / world).backward()
        opt_r.step()
    return {"done": done, "vs_replay": max_diff(model, replay)}


def skipped_collective(rank: int, world: int) -> str:
    """The last rank skips a backward: the others must time out naming it (and only it), not hang.

    Rank 0 builds one wrapper more than the others first (over a group of its own), so the ranks' counts of
    wrappers built differ: the names under which they publish their progress must still line up.
    """
    solo = dist.new_group([0])  # every rank takes part in creating a group, members or not
    if rank == 0:
        DDP(mlp(), process_group=solo, timeout=30)
    ddp = DDP(mlp(), timeout=2.0)
    x, y = batches(1)[0]
    if rank == world - 1:
        time.sleep(6)
        return "skipped"
    start = time.monotonic()
    try:
        F.cross_entropy(ddp(x), y).backward()
    except DistributedError as exc:
        message = f"{time.monotonic() - start:.1f}s: {exc}"
        time.sleep(1.5)  # rank 0 hosts the store: stay up while the other rank reads it
        return message
    return "no error"


def process_group_required() -> str:
    """Outside any process group (called in the parent process)."""
    if dist.is_initialized():
        return "initialised"
    try:
        DDP(mlp())
    except DistributedError as exc:
        return str(exc)
    return "no error"


def parallel_with_tiny_batches(rank: int, world: int) -> dict[str, Any]:
    """Through Parallel and a user's DataLoader: global batches of 2 leave rank 2 of 3 with nothing."""
    from torch.utils.data import DataLoader, TensorDataset

    import paratrain

    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))
    reference = mlp()
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=2):
        opt_r.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt_r.step()
    par = paratrain.Parallel("ddp", "cpu")
    model, loader = par.prepare(mlp(), DataLoader(data, batch_size=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = []
    for x, y in loader:
        local.append(len(x))
        opt.zero_grad()
        par.backward(F.cross_entropy(model(x), y))
        opt.step()
    return {"local": local, "vs_single": max_diff(par.unwrap(model), reference)}


def peer_exits(rank: int, world: int) -> str:
    """The last rank's process ends mid-run: the others fail naming it, not just "Connection closed by peer"."""
    ddp = DDP(mlp(), timeout=30)
    x, y = batches(1)[0]
    F.cross_entropy(ddp(x), y).backward()  # one good step: every pair of ranks is connected
    if rank == world - 1:
        os._exit(3)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except DistributedError as exc:
        return str(exc)
    return "no error"


def watchdog_ends_a_hang(rank: int, world: int) -> float:
    """Rank 0 waits the way it does on GPUs (the host never blocks on a timeout; the watchdog follows the
    collective); rank 1 stalls. Rank 0's watchdog must name rank 1 and end rank 0's process."""
    ddp = DDP(mlp(), timeout=2.0)
    x, y = batches(1)[0]
    F.cross_entropy(ddp(x), y).backward()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        ddp.monitor.host_waits = False
        store.set("watchdog/pid", str(os.getpid()))
        F.cross_entropy(ddp(x), y).backward()  # never returns: rank 1 does not take part
        return -1.0
    pid = int(store.get("watchdog/pid"))
    start = time.monotonic()
    while time.monotonic() - start < 30:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def clean_at_exit(rank: int, world: int) -> dict[str, Any]:
    """Nothing the wrapper leaves behind may need the GIL while the interpreter finalizes, and no thread of ours
    outlives the wrapper or the process group.

    A gloo Work copies the thread-local state when it is created; inside backward that state holds the Python
    Context torch stashes for the backward, and a Work freed last by gloo's thread during finalization aborts the
    process (SIGABRT after a finished job). Count the references the gradient all-reduces hold to that Context,
    and watch the board's thread. Run last: it destroys the process group.
    """
    import gc
    import sys
    import threading

    kept: list[Any] = []
    original = dist.all_reduce

    def keeping(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        kept.append(work)
        return work

    net = mlp()
    ddp = DDP(net, timeout=30)
    contexts: list[Any] = []
    next(net.parameters()).register_post_accumulate_grad_hook(
        lambda p: contexts.append(torch._C._get_obj_in_tls("context"))
    )
    x, y = batches(1)[0]
    dist.all_reduce = keeping
    try:
        F.cross_entropy(ddp(x), y).backward()
    finally:
        dist.all_reduce = original
    gc.collect()
    refs_from_works = sys.getrefcount(contexts[0]) - 2  # less this list's and getrefcount's own
    collected = ddp.monitor._board._thread
    alive = collected.is_alive()
    kept.clear()
    del ddp
    gc.collect()
    closed = DDP(mlp(), timeout=30)
    closed_thread = closed.monitor._board._thread
    closed.close()
    dist.destroy_process_group()
    ours = [t.name for t in threading.enumerate() if t.name.startswith("paratrain")]
    return {
        "context_refs_from_works": refs_from_works,
        "board_alive": alive,
        "board_after_del": collected.is_alive(),
        "board_after_close": closed_thread.is_alive(),
        "threads_left": ours,
    }
