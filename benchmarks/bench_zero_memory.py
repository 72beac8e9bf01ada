"""How much memory does each rank hold, and at most use, under ddp, zero1, zero2 and zero3, against the ZeRO formula?

    python benchmarks/bench_zero_memory.py                 # N = 1..4 ranks over gloo: 10M, 53.6M and a deep 25M MLP
    python benchmarks/bench_zero_memory.py --quick         # the 10M MLP at N = 1, 2 only: a smoke run

Each (model, N, strategy) runs in N fresh processes of its own: fp32 AdamW, :data:`STEPS` training steps
(``zero_grad``, ``par.backward``, ``par.step``), the same model and data for every strategy. Two figures per rank:

- held: after the last step every tensor alive in the process is found (``gc``), tensors sharing storage counted
  once, and their storage bytes summed, less what the process held before the model was built. That is the
  model state the rank keeps between steps: the weights (whole, or under zero3 this rank's shard of each unit),
  the gradients (whole under ddp and zero1, this rank's parts under zero2 and zero3) and AdamW's two moments
  (whole, or this rank's shard). The formula (Rajbhandari et al. 2020, Ψ parameters, N ranks): ddp 16Ψ, zero1
  8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N; the target: within 5%. ``zero_grad`` comes before each backward, so
  the last step's gradients are alive when it is measured; the same figure after a last
  ``zero_grad(set_to_none=True)`` is reported beside it: only zero3 drops its gradient shards then (12Ψ/N).
  zero3 holds no gathered unit between steps: each unit's gathered buffer is released after its backward (the
  root's, which stays gathered through a training forward, at the end of backward) by shrinking its storage to
  0 bytes, and a parameter between uses is a NaN scalar expanded to its shape (4 bytes a unit); such storages
  count 0 or 4 bytes, so the held figure is the shards only, plus each unit's padding to N parts. Its units (the
  default policy: every child of the ``Sequential`` with at least 65536 parameters, the root holding the last
  ``Linear``) are printed.
- peak: on CPU, the process's peak resident set (``VmHWM`` in /proc/self/status, reset through
  /proc/self/clear_refs just before the model is built; ``ru_maxrss`` where that cannot be reset) less the
  resident set at that moment. That is what the machine sees, and it counts every allocation: the buffers of
  backward, the optimizer's temporaries, and what the gloo backend allocates inside a collective (its
  reduce-scatter clones the whole input, its all-gather gathers into a flat buffer of its own), which a tracker
  of Python-visible tensors (a ``TorchDispatchMode``) never sees. That is why this benchmark reads the resident
  set and not such a tracker, and why every strategy gets fresh processes: a process's peak is the peak of
  everything it ran before, and freed memory that malloc keeps would be counted for the next strategy. The
  resident set also counts malloc's own retention and the pages of torch's libraries first touched during the
  steps, so it is an upper bound of the live bytes, the same for every strategy. On CUDA:
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was allocated then. The
  target: zero3 <= zero2 <= zero1 <= ddp at every N > 1. zero3's peak is its held state plus what its backward
  has in flight, which does not shrink with N. Over gloo: the unit computing and the one prefetched, gathered
  (two units' weights, each gathered by one broadcast per rank in place: no flat output of gloo's), and one unit's
  whole gradient at a time: autograd's gradients are kept aside until the unit's backward is over and its weights
  are released, then copied into the unit's flat gradient and all-reduced in place, and a unit's all-reduce is
  settled (this rank's part of it kept, the rest freed) before the next unit's backward computes its gradients
  and before the unit after that is prefetched. About three times the largest unit's bytes, plus this rank's
  part of one unit for a moment. Until 2026-12-03 it was more: the gradient and its flat copy, and the unit
  reducing beside the one computing (up to ``MAX_REDUCING`` (2, then 1) of them, each with gloo's clone of its
  whole gradient), and zero3's peak was above zero2's for the 10M and 53.6M MLPs (each unit a sixth to a third
  of the model). Over NCCL the flat copy and ``MAX_REDUCING`` (1) unit reducing beside the one computing remain.

Beside each peak: the *live peak* (the peak less what the resident set holds beyond the live tensors after the
steps, ``resident - held``: library pages and malloc's own) and ``paratrain plan``'s total for the same model,
AdamW and per-rank batch (:func:`paratrain.tools.plan_memory.memory_rows`), with plan's error against it.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (:data:`FIXED_MALLOC`): every block of 64 KiB or more is mapped
on its own and unmapped when freed, so the resident set follows the live bytes and the peak is their high-water
mark. With glibc's defaults (``--system-malloc``) freed blocks up to 32 MiB are kept for reuse, in one arena per
thread, and the peak also counts what malloc kept, which depends on the order of allocations more than on what
the strategy needs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import print_table, write_json
from torch import nn

import paratrain
from paratrain.sharded.units import plan_units

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
TOLERANCE = 0.05
STEPS = 3  # training steps measured: a step after the first also holds what the one before it left behind
BYTES_PER_PARAM = {  # (whole, divided by N): fp32 weights 4, gradients 4, AdamW's two moments 8
    "ddp": (16, 0),
    "zero1": (8, 8),
    "zero2": (4, 12),
    "zero3": (0, 16),  # every unit's weights sharded too; none is gathered between steps (module docstring)
}
MODELS = {  # name: (input width, hidden width, hidden layers)
    "mlp 10M": (784, 2048, 3),
    "mlp 53.6M": (784, 4096, 4),
    "mlp 25.0M deep": (784, 1024, 24),  # zero3's units small against the model: 24 of 1.05M parameters
}
# every allocation of 64 KiB or more its own mapping, unmapped when freed (glibc): the resident set follows the live
# bytes. By default glibc raises that threshold to the largest block freed (up to 32 MiB) and keeps freed blocks
# below it for reuse, so the peak would count what malloc kept, more in the arenas of gloo's threads
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def mlp(inputs: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def held_bytes() -> int:
    """Storage bytes of every tensor alive in this process that Python can reach, each storage counted once."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some lazy module objects warn about
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue  # a wrapper without storage of its own (zero2's placeholder gradients): no bytes
            if storage.nbytes():
                storages[pointer] = storage.nbytes()
    return sum(storages.values())


class PeakMeter:
    """The peak memory of this process from :meth:`start` on, less what it used at that moment (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.method = ""
        self.base = 0

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.method, self.base = "torch.cuda.max_memory_allocated", torch.cuda.memory_allocated()
            return
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident set (Linux 4.0 on)
            self.method = "VmHWM"
        except OSError:
            self.method = "ru_maxrss"  # cannot be reset: right only if the peak so far is the resident set now
        self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self.method == "VmHWM":
            return _status_kib("VmHWM") * 1024 - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} line; this benchmark reads the resident set on Linux")


def measure(strategy: str, spec: tuple[int, int, int], batch: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, spec[0], generator=g), torch.randint(0, 10, (batch,), generator=g))] * STEPS
    with paratrain.Parallel(strategy, device.type) as par:
        before = held_bytes()
        meter = PeakMeter(device)
        meter.start()
        net = mlp(*spec)
        params = sum(p.numel() for p in net.parameters())
        # zero3's units under its default policy: (name, parameters); "" is the root
        units = [(u.name, u.numel) for u in plan_units(net)] if strategy == "zero3" else []
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net, opt, loader = par.prepare(net, opt, data)
        for x, y in loader:
            opt.zero_grad()  # before the backward: the last step's gradients are held when it ends
            par.backward(nn.functional.cross_entropy(net(x), y))
            par.step(opt)
        peak = meter.peak()
        del x, y, loader
        held = held_bytes() - before
        resident = _status_kib("VmRSS") * 1024 - meter.base if meter.method == "VmHWM" else None
        opt.zero_grad()  # set_to_none: what each strategy still holds without gradients
        cleared = held_bytes() - before
        del net, opt
    return {
        "params": params,
        "units": units,
        "bytes": held,
        "bytes_after_zero_grad": cleared,
        "peak_bytes": peak,
        "peak_method": meter.method,
        "resident_bytes": resident,  # the resident set after the steps, less before the model (CPU)
    }


def worker(rank: int, world: int, store: str, model: str, strategy: str, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.device_count() >= world else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init = f"file://{store}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    found = measure(strategy, MODELS[model], 4 * world, device)
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    os._exit(0)  # the group's teardown is not what is measured


def run(world: int, model: str, strategy: str) -> list[dict[str, Any]]:
    """One strategy on one model at ``world`` ranks, in fresh processes: each rank's figures."""
    with tempfile.TemporaryDirectory(prefix="bench-zero-memory-") as tmp:
        args = (world, f"{tmp}/store", model, strategy, tmp)  # the children read MALLOC_* from the environment
        mp.start_processes(worker, args=args, nprocs=world, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def formula_bytes(strategy: str, params: int, world: int) -> float:
    whole, divided = BYTES_PER_PARAM[strategy]
    return whole * params + divided * params / world


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _bytes_per_param(whole: int, divided: int) -> str:
    if not divided:
        return f"{whole}"
    return f"{whole}+{divided}/N" if whole else f"{divided}/N"


def planned_bytes(model: str, world: int, backend: str) -> dict[str, int]:
    """What ``paratrain plan`` predicts each strategy's rank uses at most (its memory table's total), for the
    benchmark's model, optimizer and per-rank batch."""
    from paratrain.tools.plan_memory import activation_bytes, memory_rows  # here only: not in the spawned ranks

    net = mlp(*MODELS[model])
    sample = torch.zeros(1, MODELS[model][0])
    saved = activation_bytes(net, sample, 4)  # the benchmark's 4 samples per rank
    rows = memory_rows(net, "adamw", 0.0, [world], lambda _n: saved, backend=backend)
    return {row.strategy: row.total for row in rows}


def live_peak(rank: dict[str, Any]) -> int | None:
    """The peak less what the resident set holds beyond the live tensors after the steps (torch's library pages,
    malloc's own): the peak of the bytes a model of the tensors can predict (CPU only)."""
    if rank.get("resident_bytes") is None:
        return None
    return int(rank["peak_bytes"] - (rank["resident_bytes"] - rank["bytes"]))


def in_order(peaks: dict[str, int]) -> bool:
    """The target: zero3 <= zero2 <= zero1 <= ddp (each the worst rank's peak)."""
    return peaks["zero3"] <= peaks["zero2"] <= peaks["zero1"] <= peaks["ddp"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-world-size", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the 10M MLP at N = 1, 2: a smoke run")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="only these models (default: all)")
    parser.add_argument("--min-world-size", type=int, default=1)
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    parser.add_argument(
        "--system-malloc", action="store_true", help="malloc's defaults: the peak then counts what malloc keeps"
    )
    args = parser.parse_args()
    if not args.system_malloc:
        os.environ.update(FIXED_MALLOC)  # inherited by the spawned ranks, read by malloc when it starts
    models = ["mlp 10M"] if args.quick else list(args.models or MODELS)
    sizes = range(args.min_world_size, (2 if args.quick else args.max_world_size) + 1)
    rows, results, orders = [], [], []
    unit_plans: dict[str, list[tuple[str, int]]] = {}
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for name in models:
        for n in sizes:
            peaks = {}
            planned = planned_bytes(name, n, backend)
            for strategy in STRATEGIES:
                ranks = run(n, name, strategy)
                measured = [rank["bytes"] for rank in ranks]
                cleared = [rank["bytes_after_zero_grad"] for rank in ranks]
                if strategy == "zero3":
                    unit_plans[name] = [tuple(unit) for unit in ranks[0]["units"]]
                peak = [rank["peak_bytes"] for rank in ranks]
                psi = ranks[0]["params"]
                formula = formula_bytes(strategy, psi, n)
                worst = max(measured, key=lambda b: abs(b / formula - 1))
                error = worst / formula - 1
                peaks[strategy] = max(peak)
                lives = [live_peak(rank) for rank in ranks]
                live = max(lives) if None not in lives else None  # type: ignore[type-var]
                plan_error = planned[strategy] / live - 1 if live else None
                results.append(
                    {
                        "model": name,
                        "params": psi,
                        "world_size": n,
                        "strategy": strategy,
                        "measured_bytes_per_rank": measured,
                        "after_zero_grad_bytes_per_rank": cleared,
                        "peak_bytes_per_rank": peak,
                        "peak_method": ranks[0]["peak_method"],
                        "formula_bytes": formula,
                        "error": error,
                        "within": abs(error) <= TOLERANCE,
                        "resident_bytes_per_rank": [rank.get("resident_bytes") for rank in ranks],
                        "live_peak_bytes": live,
                        "plan_bytes": planned[strategy],
                        "plan_error": plan_error,
                    }
                )
                whole, divided = BYTES_PER_PARAM[strategy]
                rows.append(
                    [
                        name,
                        n,
                        strategy,
                        f"{max(measured) / 2**20:.1f}",
                        f"{max(cleared) / 2**20:.1f}",
                        f"{max(peak) / 2**20:.1f}",
                        f"{formula / 2**20:.1f}",
                        _bytes_per_param(whole, divided),
                        f"{error:+.2%}",
                        "yes" if abs(error) <= TOLERANCE else "NO",
                        f"{live / 2**20:.1f}" if live is not None else "-",
                        f"{planned[strategy] / 2**20:.1f}",
                        f"{plan_error:+.1%}" if plan_error is not None else "-",
                    ]
                )
            if n > 1:
                orders.append(
                    {
                        "model": name,
                        "world_size": n,
                        "in_order": in_order(peaks),
                        "zero2_zero1_ddp": peaks["zero2"] <= peaks["zero1"] <= peaks["ddp"],
                        "zero3_zero2": peaks["zero3"] <= peaks["zero2"],
                        "peak_bytes": peaks,
                    }
                )
    headers = [
        "model",
        "N",
        "strategy",
        "held MiB",
        "zero_grad MiB",
        "peak MiB",
        "formula MiB",
        "bytes/param",
        "error",
        "within 5%",
        "live peak MiB",
        "plan MiB",
        "plan error",
    ]
    print_table(headers, rows)
    print(f"\nheld: every tensor alive in the rank after {STEPS} fp32 AdamW steps (zero_grad before each backward,")
    print("so the last step's gradients are alive), storages counted once; zero_grad: the same after a last")
    print("zero_grad(set_to_none=True). peak: the rank's peak resident set during the steps less its resident set")
    print("before the model was built (CUDA: max_memory_allocated); each the worst rank's. formula (held): ddp 16Ψ,")
    print("zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N (no unit is gathered between steps). live peak: the peak")
    print("less what the resident set held beyond the live tensors after the steps (library pages, malloc's own);")
    print(f"plan: `paratrain plan`'s total for this model and batch ({backend}); plan error: plan / live peak - 1")
    for name, plan in unit_plans.items():
        listed = ", ".join(f"{unit or '(root)'} {numel / 1e6:.2f}M" for unit, numel in plan)
        print(f"zero3 units of {name} (the default policy): {len(plan)}: {listed}")
    for order in orders:
        listed = ", ".join(f"{s} {order['peak_bytes'][s] / 2**20:.1f}" for s in reversed(STRATEGIES))
        print(
            f"peak zero3 <= zero2 <= zero1 <= ddp, {order['model']} at N = {order['world_size']}: "
            f"{_yes(order['in_order'])} (zero2 <= zero1 <= ddp {_yes(order['zero2_zero1_ddp'])}, zero3 <= zero2 "
            f"{_yes(order['zero3_zero2'])}; {listed} MiB)"
        )
    ok = all(r["within"] for r in results) and all(o["in_order"] for o in orders)
    payload = {
        "tolerance": TOLERANCE,
        "steps": STEPS,
        "ok": ok,
        "results": results,
        "peak_order": orders,
        "zero3_units": unit_plans,
    }
    write_json("bench_zero_memory", payload, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
