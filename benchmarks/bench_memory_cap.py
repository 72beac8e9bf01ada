"""Does a model too large for one capped process train under zero3 at N = 2, where ddp cannot?

    python benchmarks/bench_memory_cap.py                      # ddp and zero3 at N = 2 under the cap
    python benchmarks/bench_memory_cap.py --find-threshold     # also: the smallest cap each strategy trains under

Each strategy runs in two fresh processes over gloo (spawned, one thread each), fp32 AdamW, :data:`STEPS` steps
of an MLP whose units are small against the whole (:data:`MODEL`). Just before the model is built, each rank caps
its own memory: ``RLIMIT_DATA`` (``setrlimit``) set to the data segment it has then (``VmData`` in
/proc/self/status) plus the cap C. Since Linux 4.7 RLIMIT_DATA counts every private writable mapping, and with
``MALLOC_MMAP_THRESHOLD_=65536`` every block of 64 KiB or more (every tensor of this model) is a mapping of its own,
unmapped when freed, so the limit bounds the bytes the rank allocates from then on: an allocation past it fails
(torch's CPU allocator raises ``DefaultCPUAllocator: can't allocate memory``), at the allocation that crosses it,
whatever touched the pages or not. ``MALLOC_ARENA_MAX=2`` keeps malloc from reserving an arena per thread.

- ddp builds the model plainly (it holds it whole: weights, gradients, AdamW's two moments, 16Ψ bytes);
- zero3 builds it on the meta device (``with torch.device("meta")``), so ``par.prepare`` materialises it unit by
  unit and the whole model never exists on one rank: 16Ψ/N bytes held, plus the units in flight.

A rank whose allocation fails writes its result (the error's first line, the phase it was in) and exits at once;
the other rank's next collective then fails on the closed connection (the process group's timeout,
:data:`GROUP_TIMEOUT_S`, bounds it otherwise), and the parent kills whatever is left after :data:`RUN_TIMEOUT_S`.
The demonstration holds, and the exit code is 0, when ddp fails with the out-of-memory error and zero3 trains
every step. ``--find-threshold`` bisects, for each strategy, the smallest cap it trains under (to
:data:`THRESHOLD_STEP` bytes): the evidence that the cap bites where the state says it should, not earlier
(ddp's threshold near 16Ψ plus its temporaries, zero3's near 8Ψ plus its units in flight).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_common import print_table, write_json
from bench_zero_memory import PeakMeter, mlp
from torch import nn

import paratrain
from paratrain.sharded.units import plan_units

STRATEGIES = ("ddp", "zero3")
WORLD = 2
Spec = tuple[int, int, int]
MODEL: Spec = (784, 1024, 16)  # input width, hidden width, hidden layers: 16.6M parameters, 17 zero3 units
CAP_MIB = 224  # C: between zero3's need at N = 2 and ddp's (see --find-threshold)
STEPS = 3
BATCH_PER_RANK = 8
GROUP_TIMEOUT_S = 30  # a collective waiting for a rank that died fails after this
RUN_TIMEOUT_S = 180  # the parent kills a run's processes left after this
THRESHOLD_STEP = 4 * 2**20
# every allocation of 64 KiB or more its own mapping, unmapped when freed; two malloc arenas (module docstring)
CAPPED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
_STATUS = Path("/proc/self/status")
_OOM_WORDS = ("can't allocate memory", "not enough memory", "cannot allocate memory", "out of memory")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} line; this benchmark caps memory on Linux")


def is_oom(error: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, torch's OutOfMemoryError, or the CPU allocator's message."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return any(word in str(error).lower() for word in _OOM_WORDS)


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def short(error: str) -> str:
    """The allocator's words of an error's first line ("DefaultCPUAllocator: can't allocate memory: you tried to
    allocate N bytes"), without torch's source location and errno."""
    start = error.find("DefaultCPUAllocator")
    if start < 0:
        return error
    end = error.find(". Error code", start)
    return error[start : end if end > 0 else None]


def cap_memory(cap: int) -> int:
    """Limit this process's data segment to what it has now plus ``cap`` bytes; returns the limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _status_kib("VmData") * 1024 + cap
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def lift_cap() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def warm_up() -> None:
    """What the first use of AdamW and of the meta device imports (torch._dynamo: 800 modules, 66 MiB of VmData),
    done before the cap: the interpreter's code, the same for every strategy, not training state."""
    tiny = nn.Linear(2, 2)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3)
    tiny(torch.ones(1, 2)).sum().backward()
    opt.step()
    with torch.device("meta"):
        nn.Linear(2, 2)


def train(strategy: str, cap: int | None, spec: Spec, hang_report: str, result: dict[str, Any]) -> None:
    """Build the MLP ``spec``, prepare and train it under ``cap`` (None: no cap), filling ``result`` as it goes."""
    g = torch.Generator().manual_seed(1)
    inputs = spec[0]
    batch = BATCH_PER_RANK * WORLD  # the loader's batch is the global batch, cut into one share per rank
    data = [(torch.randn(batch, inputs, generator=g), torch.randint(0, 10, (batch,), generator=g))] * STEPS
    warm_up()
    with paratrain.Parallel(strategy, "cpu", timeout=GROUP_TIMEOUT_S, hang_report=hang_report) as par:
        gc.collect()
        meter = PeakMeter(torch.device("cpu"))
        meter.start()
        result["rss_before_bytes"] = meter.base
        result["data_before_bytes"] = _status_kib("VmData") * 1024
        if cap is not None:
            result["limit_bytes"] = cap_memory(cap)
        result["phase"] = "build"
        if strategy == "zero3":
            with torch.device("meta"):  # shapes only: prepare materialises it unit by unit
                net = mlp(*spec)
        else:
            net = mlp(*spec)
        result["params"] = sum(p.numel() for p in net.parameters())
        units = plan_units(net)
        result["units"] = len(units)
        result["largest_unit"] = max(u.numel for u in units)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        result["phase"] = "prepare"
        net, opt, loader = par.prepare(net, opt, data)
        losses = []
        for step, (x, y) in enumerate(loader, 1):
            result["phase"] = f"step {step} forward"
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            result["phase"] = f"step {step} backward"
            par.backward(loss)
            result["phase"] = f"step {step} optimizer"
            par.step(opt)
            losses.append(float(loss.detach()))
            result["steps"] = step
        result["phase"] = "done"
        result["final_loss"] = losses[-1]
        result["peak_bytes"] = meter.peak()
        result["data_after_bytes"] = _status_kib("VmData") * 1024


def worker(rank: int, store: str, strategy: str, cap: int | None, spec: Spec, out: str) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank, "strategy": strategy, "cap_bytes": cap, "steps": 0, "trained": False}
    path = Path(out, f"rank{rank}.json")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    try:
        train(strategy, cap, spec, str(Path(out, "hang-report.json")), result)
        result["trained"] = True
    except Exception as error:  # an allocation past the cap, or the other rank gone: reported, not raised
        lift_cap()  # room to report it
        result["error"] = first_line(error)
        result["oom"] = is_oom(error)
        result["data_at_error_bytes"] = _status_kib("VmData") * 1024
        if "rss_before_bytes" in result:
            result["peak_bytes"] = _status_kib("VmHWM") * 1024 - result["rss_before_bytes"]
    lift_cap()
    path.write_text(json.dumps(result))
    if result["trained"]:
        dist.barrier()  # the other rank has written its result too
    os._exit(0)  # no process-group teardown: a failed group's could wait for the rank that left


def run(strategy: str, cap: int | None, spec: Spec = MODEL) -> list[dict[str, Any]]:
    """One strategy at N = 2 in fresh processes under ``cap``: each rank's result (a stand-in where it left none)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-memory-cap-") as tmp:
        procs = [
            ctx.Process(target=worker, args=(rank, f"{tmp}/store", strategy, cap, spec, tmp), daemon=True)
            for rank in range(WORLD)
        ]
        saved = {name: os.environ.get(name) for name in CAPPED_MALLOC}
        os.environ.update(CAPPED_MALLOC)  # inherited by the spawned ranks, read by malloc when it starts
        try:
            for proc in procs:
                proc.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        killed = []
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
                killed.append(proc.pid)
        results = []
        for rank, proc in enumerate(procs):
            path = Path(tmp, f"rank{rank}.json")
            if path.exists():
                results.append(json.loads(path.read_text()))
            else:
                why = "killed after the run's timeout" if proc.pid in killed else f"exit code {proc.exitcode}"
                results.append(
                    {"rank": rank, "strategy": strategy, "trained": False, "steps": 0, "oom": False, "error": why}
                )
        return results


def summary(strategy: str, cap: int | None, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's outcome: trained (every rank every step), or the out-of-memory error (or another) and where."""
    trained = all(r["trained"] and r["steps"] == STEPS for r in ranks)
    failed = [r for r in ranks if not r["trained"]]
    oom = [r for r in failed if r.get("oom")]
    first = (oom or failed or [{}])[0]
    losses = [r["final_loss"] for r in ranks if "final_loss" in r]
    peaks = [r["peak_bytes"] for r in ranks if "peak_bytes" in r]
    return {
        "strategy": strategy,
        "cap_bytes": cap,
        "trained": trained,
        "oom": bool(oom),
        "steps": min(r["steps"] for r in ranks),
        "final_loss": sum(losses) / len(losses) if trained and losses else None,  # the global batch's
        "error": None if trained else first.get("error"),
        "error_rank": None if trained else first.get("rank"),
        "phase": None if trained else first.get("phase"),
        "peak_bytes": max(peaks) if peaks else None,
        "params": next((r["params"] for r in ranks if "params" in r), None),
        "ranks": ranks,
    }


def find_threshold(strategy: str, low: int, high: int) -> tuple[int, list[dict[str, Any]]]:
    """The smallest cap (to :data:`THRESHOLD_STEP`) under which ``strategy`` trains, given ``low`` fails and ``high``
    trains (checked); every run's summary."""
    tried = []
    for cap in (high, low):
        outcome = summary(strategy, cap, run(strategy, cap))
        tried.append(outcome)
        if outcome["trained"] != (cap == high):
            raise RuntimeError(f"{strategy} under a cap of {cap / 2**20:.0f} MiB: {outcome['error'] or 'trained'}")
    while high - low > THRESHOLD_STEP:
        cap = (low + high) // 2
        outcome = summary(strategy, cap, run(strategy, cap))
        tried.append(outcome)
        said = "trained" if outcome["trained"] else f"{outcome['phase']}: {short(outcome['error'] or '')}"
        print(f"  {strategy} under {cap / 2**20:.1f} MiB: {said}")
        if outcome["trained"]:
            high = cap
        else:
            low = cap
    return high, tried


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=float, default=CAP_MIB, help=f"C, per process (default {CAP_MIB})")
    parser.add_argument(
        "--find-threshold", action="store_true", help="also bisect the smallest cap each strategy trains under"
    )
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    cap = int(args.cap_mib * 2**20)
    outcomes = [summary(strategy, cap, run(strategy, cap)) for strategy in STRATEGIES]
    psi = next(o["params"] for o in outcomes if o["params"])
    with torch.device("meta"):
        units = plan_units(mlp(*MODEL))
    largest = max(u.numel for u in units)
    rows = []
    for o in outcomes:
        outcome = f"trained {o['steps']} steps" if o["trained"] else ("out of memory" if o["oom"] else "failed")
        where = "" if o["trained"] else f"rank {o['error_rank']}, {o['phase']}: {short(o['error'] or '')}"
        loss = "-" if o["final_loss"] is None else f"{o['final_loss']:.4f}"
        rows.append([o["strategy"], WORLD, _mib(cap), outcome, loss, _mib(o["peak_bytes"]), where])
    print(
        f"\nMLP {MODEL[0]}-{MODEL[1]}x{MODEL[2]}-10: {psi / 1e6:.1f}M parameters (Ψ), "
        f"{len(units)} zero3 units, the largest {largest / 1e6:.2f}M; fp32 AdamW state 16Ψ = {_mib(16 * psi)} MiB, "
        f"at N = {WORLD} under zero3 16Ψ/N = {_mib(16 * psi / WORLD)} MiB"
    )
    headers = ["strategy", "N", "cap MiB", "outcome", "final loss", "peak MiB", "error"]
    print_table(headers, rows)
    print("\ncap: RLIMIT_DATA set to the rank's VmData plus the cap just before the model is built; peak: the rank's")
    print("peak resident set from then on less its resident set then (at the error, for a run that failed); the worst")
    print("rank. ddp builds the model whole, zero3 on the meta device (materialised unit by unit by prepare).")
    thresholds: dict[str, Any] = {}
    if args.find_threshold:
        print("\nthe smallest cap each strategy trains under (bisection):")
        for strategy in STRATEGIES:
            found, tried = find_threshold(strategy, 0, 2 * 16 * psi)
            thresholds[strategy] = {"threshold_bytes": found, "runs": tried}
        state = {"ddp": 16 * psi, "zero3": 16 * psi / WORLD}
        rows = [
            [s, _mib(t["threshold_bytes"]), _mib(state[s]), _mib(t["threshold_bytes"] - state[s])]
            for s, t in thresholds.items()
        ]
        print_table(["strategy", "threshold MiB", "state MiB (16Ψ, 16Ψ/N)", "above the state MiB"], rows)
    ddp = next(o for o in outcomes if o["strategy"] == "ddp")
    zero3 = next(o for o in outcomes if o["strategy"] == "zero3")
    holds = ddp["oom"] and not ddp["trained"] and zero3["trained"]
    print(
        f"\nddp fails with out-of-memory and zero3 trains under {_mib(cap)} MiB per process: {'yes' if holds else 'NO'}"
    )
    payload = {
        "model": list(MODEL),
        "params": psi,
        "units": len(units),
        "largest_unit": largest,
        "world_size": WORLD,
        "steps": STEPS,
        "cap_bytes": cap,
        "mechanism": "RLIMIT_DATA = VmData + cap, set before the model is built",
        "malloc": CAPPED_MALLOC,
        "holds": holds,
        "results": outcomes,
        "thresholds": thresholds,
    }
    write_json("bench_memory_cap", payload, args.out)
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
