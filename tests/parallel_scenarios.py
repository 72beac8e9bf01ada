"""What each rank runs in the multi-process tests of ``Parallel``; every function returns JSON-able findings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from ddp_scenarios import max_diff, mlp

SAMPLES = 23  # batches of 5 split 2, 2, 1 over three ranks; the last batch of 3 splits 1, 1, 1


def _data(seed: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))


def _global_batches(par: paratrain.Parallel, loader: Any) -> list[list[int]]:
    """The sample ids of every global batch, put back together from each rank's share."""
    return [par.gather(ids).tolist() for (ids,) in loader]


def gather_pads_and_trims(rank: int, world: int) -> dict[str, Any]:
    """Parts of unequal length, empty parts, 2-d parts and 0-dim tensors, gathered in rank order."""
    par = paratrain.Parallel("ddp", "cpu")
    ragged = par.gather(torch.arange(rank + 1, dtype=torch.float64) + 10 * rank)  # 1, 2, 3 entries
    empty_on_last = par.gather(torch.full((0 if rank == world - 1 else 2, 3), rank, dtype=torch.int64))
    scalar = par.gather(torch.tensor(float(rank)))
    all_empty = par.gather(torch.zeros(0, 2))
    return {
        "ragged": ragged.tolist(),
        "ragged_dtype": str(ragged.dtype),
        "empty_on_last": empty_on_last.tolist(),
        "scalar": scalar.tolist(),
        "all_empty_shape": list(all_empty.shape),
    }


def user_shuffle_order(rank: int, world: int) -> dict[str, Any]:
    """A user's DataLoader under ddp: the same global batches, in the same order, as in one process."""
    par = paratrain.Parallel("ddp", "cpu")
    ids = TensorDataset(torch.arange(SAMPLES))
    found: dict[str, Any] = {}

    # with the user's own generator: no process may re-seed it
    user_generator = torch.Generator().manual_seed(7)
    loader = DataLoader(ids, batch_size=5, shuffle=True, generator=user_generator)
    sampler = loader.sampler
    one_process = [
        b.tolist() for (b,) in DataLoader(ids, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7))
    ]
    found["generator_batches"] = _global_batches(par, par.prepare(loader)) == one_process
    found["generator_kept"] = loader.sampler is sampler and sampler.generator is user_generator

    # without a generator: the order comes from the global RNG, which has drifted apart across ranks
    torch.manual_seed(11)
    torch.rand(rank)  # rank r draws r numbers more than rank 0
    state = torch.get_rng_state()
    plain = DataLoader(ids, batch_size=5, shuffle=True)
    prepared = par.prepare(plain)
    epochs = [_global_batches(par, prepared) for _ in range(2)]
    after = torch.get_rng_state()
    torch.set_rng_state(state)  # one process with rank 0's generator state sees these batches
    expected = [[b.tolist() for (b,) in plain] for _ in range(2)] if rank == 0 else None
    # rank 0's generator advanced exactly as one process's would
    found["rng_like_one_process"] = rank != 0 or torch.equal(after, torch.get_rng_state())
    found["plain_batches"] = epochs
    found["plain_expected"] = expected
    found["plain_generator_left_alone"] = plain.sampler.generator is None
    par.close()
    return found


def eval_loader_between_forward_and_backward(rank: int, world: int) -> dict[str, Any]:
    """A train and an eval loader interleaved: each backward is weighted by its own batch's share."""
    data, held_out = _data(4), _data(5)
    reference = mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=5):
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()

    par = paratrain.Parallel("ddp", "cpu")
    model, train_loader, eval_loader = par.prepare(
        mlp(), DataLoader(data, batch_size=5), DataLoader(held_out, batch_size=7)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(train_loader):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        # mid-step evaluation: its batches (7 samples: shares 3, 2, 2) must not change this step's weight
        if step % 2 == 0:
            with torch.no_grad():
                for ex, _ in eval_loader:
                    model(ex)
        else:
            for _batch in eval_loader:  # just iterated, with autograd on
                pass
        par.backward(loss)
        opt.step()
    found = {"vs_single": max_diff(par.unwrap(model), reference)}
    par.close()
    return found


def train_job(rank: int, world: int, settings: dict[str, Any]) -> dict[str, Any]:
    """``paratrain train``'s job under ddp in this process group."""
    from paratrain.training import TrainConfig, train

    result = train(TrainConfig(strategy="ddp", devices="cpu", quiet=True, **settings))
    return {"epoch_losses": result.epoch_losses, "test_accuracy": result.test_accuracy}


def batched_loader_order(rank: int, world: int) -> dict[str, Any]:
    """A DataLoader over a TensorDataset takes the indexed path under ddp: the same batches, bit for bit, in the
    order one process's DataLoader gives, and rank 0's generator ends the epoch where one process's does."""
    par = paratrain.Parallel("ddp", "cpu")
    data = _data(seed=9)
    torch.manual_seed(5 + rank)  # the ranks' generators differ: the order must still be rank 0's
    prepared = par.prepare(DataLoader(data, batch_size=5, shuffle=True))
    path = prepared.path
    torch.manual_seed(5 + rank)
    batches = [[par.gather(x), par.gather(y)] for x, y in prepared]
    after = torch.get_rng_state()
    torch.manual_seed(5)
    alone = list(DataLoader(data, batch_size=5, shuffle=True))
    same = len(batches) == len(alone) and all(
        torch.equal(a, b) for got, want in zip(batches, alone, strict=True) for a, b in zip(got, want, strict=True)
    )
    return {"path": path, "same_batches": same, "rng_as_one_process": bool(torch.equal(after, torch.get_rng_state()))}


def unmatched_batch_warns_once(rank: int, world: int) -> dict[str, Any]:
    """Under ddp a forward's batch weighs its loss; one that no prepared loader yielded, while two are alive, warns
    once (it takes the latest loader's share) instead of silently choosing."""
    import warnings

    par = paratrain.Parallel("ddp", "cpu")
    model = par.prepare(torch.nn.Linear(6, 4))
    train = par.prepare(DataLoader(_data(), batch_size=6))
    evaluation = par.prepare(DataLoader(_data(), batch_size=6))
    x, y = next(iter(train))
    next(iter(evaluation))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            par.backward(F.cross_entropy(model(x * 1.0), y))  # x * 1.0: not the tensor the loader yielded
        par.backward(F.cross_entropy(model(x), y))  # the loader's own tensor: matched
    return {"warnings": [str(w.message) for w in caught if "no prepared loader yielded unchanged" in str(w.message)]}


def forgot_prepare(rank: int, world: int) -> dict[str, Any]:
    """The loop runs a model that was never prepared: under ddp each rank would train its own copy."""
    par = paratrain.Parallel("ddp", "cpu")
    model = mlp()  # not par.prepare(model)
    (loader,) = (par.prepare(DataLoader(_data(4), batch_size=6)),)
    x, y = next(iter(loader))
    try:
        par.backward(F.cross_entropy(model(x), y))
        found = {"error": None}
    except paratrain.ConfigError as exc:
        found = {"error": str(exc)}
    par.close()
    return found


def plain_backward_and_prepare_twice(rank: int, world: int) -> dict[str, Any]:
    """loss.backward() where par.backward(loss) belongs (refused at the step after it, before any parameter moves),
    and prepare() of what it prepared already (refused at once), on every rank; the loop then trains on."""
    par = paratrain.Parallel("ddp", "cpu")
    torch.manual_seed(0)
    net = mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer, loader = par.prepare(net, optimizer, DataLoader(_data(4), batch_size=6))
    x, y = next(iter(loader))
    found: dict[str, Any] = {}
    before = [p.detach().clone() for p in net.parameters()]
    F.cross_entropy(model(x), y).backward()
    try:
        optimizer.step()
        found["backward"] = None
    except paratrain.ConfigError as exc:
        found["backward"] = str(exc)
    found["unchanged_after_refusal"] = all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    optimizer.zero_grad()
    for name, again in (("model", net), ("prepared model", model), ("optimizer", optimizer), ("loader", loader)):
        try:
            par.prepare(again)
            found[name] = None
        except paratrain.ConfigError as exc:
            found[name] = str(exc)
    par.backward(F.cross_entropy(model(x), y))  # the loop goes on, as written
    optimizer.step()
    found["weight"] = next(net.parameters()).detach().sum().item()
    par.close()
    return found


class _SpareHead(torch.nn.Module):
    """An mlp beside a head its forward never uses: under DDP that head needs find_unused_parameters or
    static_graph (without either, backward waits for its gradient and fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.spare = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train_spare_head(par: paratrain.Parallel | None) -> tuple[torch.nn.Module, Any]:
    """Five SGD steps of a _SpareHead on the whole batches (par None: one process, no Parallel); the user's model
    and what prepare() returned for it."""
    net = _SpareHead()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loader: Any = DataLoader(_data(4), batch_size=5)
    model: Any = net
    if par is not None:
        model, optimizer, loader = par.prepare(net, optimizer, loader)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        par.backward(loss) if par is not None else loss.backward()
        optimizer.step()
    return net, model


def _counting_hook(calls: list[int]) -> Any:
    """A communication hook that averages a bucket as the built-in all-reduce does, noting each bucket it gets."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        buffer = bucket.buffer().div_(bucket.world_size)
        work = torch.distributed.all_reduce(buffer, group=state, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def ddp_options_are_honoured(rank: int, world: int) -> dict[str, Any]:
    """DDP's options given to Parallel reach the wrapper of every strategy that honours them, and work there."""
    reference, _ = _train_spare_head(None)
    found: dict[str, Any] = {}
    for strategy in ("ddp", "zero1", "zero2"):
        for option in ({"find_unused_parameters": True}, {"static_graph": True}):
            with paratrain.Parallel(strategy, "cpu", **option) as par:
                net, wrapper = _train_spare_head(par)
                found[f"{strategy} {next(iter(option))}"] = {
                    "set": [wrapper.find_unused_parameters, wrapper.static_graph],
                    "vs_single": max_diff(net, reference),
                    "spare_untouched": net.spare.weight.grad is None,
                }
        buckets = {}
        for cap in (None, 0.0002):  # MiB: the mlp's 1.8 KB of gradients fill one bucket, or three
            with paratrain.Parallel(strategy, "cpu", bucket_cap_mb=cap) as par:
                model = par.prepare(mlp())
                buckets[str(cap)] = len(model.reducer.buckets)
        found[f"{strategy} buckets"] = buckets
    for strategy in ("ddp", "zero1"):
        calls: list[int] = []
        with paratrain.Parallel(strategy, "cpu", comm_hook=_counting_hook(calls), find_unused_parameters=True) as par:
            net, _ = _train_spare_head(par)
        found[f"{strategy} hook"] = {"calls": len(calls), "vs_single": max_diff(net, reference)}
    for view in (True, False):
        with paratrain.Parallel("ddp", "cpu", gradient_as_bucket_view=view, find_unused_parameters=True) as par:
            model = par.prepare(_SpareHead())
            x, y = next(iter(par.prepare(DataLoader(_data(4), batch_size=5))))
            par.backward(F.cross_entropy(model(x), y))
            buffers = {b.untyped_storage().data_ptr() for b in model.reducer.collective.buffers}
            grads = [p.grad for p in par.unwrap(model).body.parameters()]
            found[f"ddp grads are bucket views: {view}"] = [g.untyped_storage().data_ptr() in buffers for g in grads]
    return found


def save_from_one_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    """``if par.is_main: par.save(...)``, the line of many scripts: under ddp the main process writes the file and
    every rank trains on; every rank calling it returns once the file is there; a rank that calls it while rank 0
    went on, and (zero2) rank 0 saving slices alone, are refused at once (not after the timeout) and train on."""
    found: dict[str, Any] = {}
    base = Path(directory) / f"save-from-one-rank-{world}"
    for strategy in ("ddp", "zero2"):
        (base / strategy).mkdir(parents=True, exist_ok=True)  # a save writes into an existing directory
        with paratrain.Parallel(strategy, "cpu", timeout=120) as par:
            torch.manual_seed(0)
            net = mlp()
            model, optimizer, loader = par.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), _batches(3))
            cases: dict[str, Any] = {}
            for step, (x, y) in enumerate(loader):
                par.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                state = {"model": model, "optimizer": optimizer, "step": step}
                if step == 0:  # the main process alone
                    cases["main alone"] = _saved(par, state, base / strategy / "main.pt", par.is_main)
                elif step == 1:  # every rank: returns once the file (or directory) is written
                    cases["every rank"] = _saved(par, state, base / strategy / "every.pt", True)
                    written = base / strategy / "every.pt"  # a file (ddp) or a directory (zero2): the path given
                    cases["there on return"] = written.exists()
                elif strategy == "ddp":  # the last rank alone: rank 0 writes, and went on
                    cases["last rank alone"] = _saved(par, state, base / strategy / "last.pt", rank == world - 1)
            cases["trained on"] = next(par.unwrap(model).parameters()).detach().sum().item()
            found[strategy] = cases
    return found


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 6, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(steps)]


def _saved(par: paratrain.Parallel, state: dict[str, Any], path: Path, call: bool) -> dict[str, Any]:
    if not call:
        return {"called": False}
    try:
        written = par.save(state, path)
    except (paratrain.ConfigError, paratrain.DistributedError) as exc:
        return {"called": True, "error": f"{type(exc).__name__}: {exc}"}
    return {"called": True, "written": str(written) if written is not None else None}
