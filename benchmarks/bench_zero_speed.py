"""Are zero1, zero2 and zero3 as fast as DDP? Step times at world size 2 beside torch's DDP and FSDP2.

    python benchmarks/bench_zero_speed.py                 # 2 processes over gloo, the 10M-parameter MLP, fp32 AdamW
    python benchmarks/bench_zero_speed.py --model gpt     # a small nanoGPT-shaped model (4 blocks, 256 wide, tied head)
    python benchmarks/bench_zero_speed.py --quick         # few repeats: a smoke run, not a measurement

In every rank, with the same model, data and seed, the modes (bench_zero_modes.py) take turns block by block
(--block steps each, the order rotating every round, a barrier before each block so that both ranks start it
together): local (no communication: the compute a step needs), torch-ddp (torch's DistributedDataParallel, the
baseline of the ratios), fsdp2 and fsdp2-noreshard (torch's fully_shard on the units below and the root,
reshard_after_forward True and False), and paratrain's ddp, zero1, zero2, zero3 and zero3-noreshard. zero3 and
fsdp2 shard the same units: those paratrain's default policy picks (the MLP's large Linears, the GPT's blocks).

Before timing, after the warm-up steps, every mode's whole parameters are compared with torch-ddp's (fsdp2's
gathered from its DTensors, zero3's through its state_dict): the max abs difference of each mode is printed.

Each mode's step time is the median over blocks of a block's seconds per step (rank 0's; the ranks wait for each
other in every collective). Exposed communication is a mode's step minus local's. Targets: zero3 within 1.25x of
our ddp and faster than fsdp2; zero2 within 1.05x of our ddp; zero1 no slower than it. On a CPU machine the two
processes share its cores and the collectives compete with compute for them, so the figures move between runs.
A mode that cannot run here is printed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import print_table, write_json
from bench_zero_modes import (
    GPT,
    MODES,
    Mode,
    add_model_arguments,
    build_mode,
    build_model,
    default_batch,
    make_batch,
)

TARGETS = {"zero3": 1.25, "zero2": 1.05, "zero1": 1.0}  # the most each may take, as a multiple of our ddp's step


def _agreed_failure(error: str | None, world: int) -> str | None:
    """Any rank's failure is every rank's (so that all skip the mode together)."""
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = f"file://{store}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    x, y = make_batch(args.model, args.batch, rank)
    steps: dict[str, Mode] = {}
    skipped: dict[str, str] = {}
    for name in args.modes:  # build, then the warm-up: every mode's first steps (allocations) go untimed
        error = None
        try:
            steps[name] = build_mode(name, args.model, args.width, args.depth)
            dist.barrier()
            for _ in range(args.warmup):
                steps[name].step(x, y)
        except Exception as e:  # a mode this torch or machine cannot run: skipped, with the reason
            error = _failure(e)
        if (reason := _agreed_failure(error, world)) is not None:
            skipped[name] = reason
            steps.pop(name, None)
    initial = dict(build_model(args.model, args.width, args.depth).named_parameters())
    agreement = _agreement(steps, {k: v.detach() for k, v in initial.items()})
    modes = [m for m in args.modes if m in steps]
    blocks: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.repeats if modes else 0):
        shift = round_ % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                steps[mode].step(x, y)
            blocks[mode].append((time.perf_counter() - start) / args.block)
    result = {"blocks": blocks, "skipped": skipped, "agreement": agreement}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


def _agreement(steps: dict[str, Mode], initial: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Every mode's whole parameters against torch-ddp's (our ddp's without it): the max abs difference.

    local trained on this rank's batch alone: it should differ (what shows the comparison can see a difference),
    as the reference should differ from the initial weights (the steps moved them).
    """
    reference = "torch-ddp" if "torch-ddp" in steps else "ddp"
    if reference not in steps:
        return {}
    found: dict[str, dict[str, Any]] = {}
    full: dict[str, dict[str, torch.Tensor]] = {}
    for name, mode in steps.items():  # collectives (fsdp2, zero3): every rank, in the same order
        error = None
        try:
            full[name] = mode.full_params()
        except Exception as e:
            error = _failure(e)
        if (reason := _agreed_failure(error, dist.get_world_size())) is not None:
            found[name] = {"reference": reference, "error": reason}
            full.pop(name, None)
    if reference not in full:
        return found
    full["initial"] = initial
    ref = full[reference]
    for name, params in full.items():
        diff = max(float((params[k] - ref[k]).abs().max()) for k in ref)
        bitwise = all(torch.equal(params[k], ref[k]) for k in ref)
        found[name] = {"reference": reference, "max_abs_diff": diff, "bitwise": bitwise}
    return found


def _ratio(medians: dict[str, float], mode: str, base: str) -> float | None:
    return medians[mode] / medians[base] if mode in medians and base in medians else None


def _verdicts(medians: dict[str, float], skipped: dict[str, str]) -> list[tuple[str, bool | None]]:
    def missing(*modes: str) -> str:
        gone = [m for m in modes if m not in medians]
        return ", ".join(f"{m} {'skipped' if m in skipped else 'not run'}" for m in gone)

    lines: list[tuple[str, bool | None]] = []
    for mode, limit in TARGETS.items():
        met, missed = (
            ("no slower than", "slower than") if limit == 1.0 else (f"within {limit}x of", f"NOT within {limit}x of")
        )
        ratio = _ratio(medians, mode, "ddp")
        if ratio is None:
            lines.append((f"{mode} {met} ddp: cannot tell ({missing(mode, 'ddp')})", None))
        else:
            ok = ratio <= limit
            lines.append((f"{mode} {met if ok else missed} ddp (target <= {limit}x): {ratio:.3f}x", ok))
    if "zero3" in medians and "fsdp2" in medians:
        ok = medians["zero3"] < medians["fsdp2"]
        z3, f2 = medians["zero3"] * 1e3, medians["fsdp2"] * 1e3
        lines.append((f"zero3 {'' if ok else 'NOT '}faster than fsdp2 (reshard): {z3:.1f} vs {f2:.1f} ms", ok))
    else:
        lines.append((f"zero3 faster than fsdp2 (reshard): cannot tell ({missing('zero3', 'fsdp2')})", None))
    return lines


def run_modes(args: argparse.Namespace, world: int, prefix: str) -> dict[str, Any]:
    """``args.modes`` taking turns in ``world`` fresh processes (:func:`worker`): rank 0's blocks, skipped modes
    and agreement, with the load average before and after."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        start = mp.start_processes  # type: ignore[attr-defined]
        start(worker, args=(world, f"{tmp}/store", args, tmp), nprocs=world, start_method="spawn")
        result: dict[str, Any] = json.loads(Path(tmp, "rank0.json").read_text())
    return {**result, "load_average_before": load_before, "load_average_after": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=10, help="blocks per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode, before the agreement check")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the modes to time")
    parser.add_argument("--quick", action="store_true", help="3 blocks of 2 steps: a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = default_batch(args.model)
    if args.quick:
        args.repeats, args.block = 3, 2
    args.modes = [m for m in MODES if m in args.modes]
    world = 2
    result = run_modes(args, world, "bench-zero-speed-")
    load_before, load_after = result["load_average_before"], result["load_average_after"]
    blocks: dict[str, list[float]] = result["blocks"]
    skipped: dict[str, str] = result["skipped"]
    agreement: dict[str, dict[str, Any]] = result["agreement"]
    medians = {mode: statistics.median(samples) for mode, samples in blocks.items()}
    local = medians.get("local")
    params = sum(p.numel() for p in build_model(args.model, args.width, args.depth).parameters())
    rows: list[list[Any]] = []
    for mode in args.modes:
        if mode in skipped:
            rows.append([mode, "skipped", "-", "-", "-", "-"])
            continue
        m = medians[mode]
        rows.append(
            [
                mode,
                f"{m * 1e3:.1f}",
                f"{min(blocks[mode]) * 1e3:.1f}..{max(blocks[mode]) * 1e3:.1f}",
                "-" if mode == "local" or local is None else f"{(m - local) * 1e3:.1f}",
                "-" if (r := _ratio(medians, mode, "torch-ddp")) is None else f"{r:.3f}x",
                "-" if (r := _ratio(medians, mode, "ddp")) is None else f"{r:.3f}x",
            ]
        )
    if args.model == "mlp":
        what = f"MLP 784-{args.width}x{args.depth}-10, {params / 1e6:.1f}M parameters, batch {args.batch} per rank"
    else:
        what = (
            f"GPT {GPT.n_layer} blocks x {GPT.n_embd} wide, vocab {GPT.vocab}, tied head, {params / 1e6:.2f}M "
            f"parameters, batch {args.batch} x {GPT.seq} tokens per rank"
        )
    print(f"world size 2 over gloo, {what}, fp32 AdamW;")
    print(f"medians of {args.repeats} blocks of {args.block} steps (rank 0); load average {load_before[0]:.2f}\n")
    print_table(["mode", "step ms", "range ms", "exposed comm ms", "vs torch-ddp", "vs ddp"], rows)
    for mode, reason in skipped.items():
        print(f"{mode} skipped: {reason}")
    reference = next(iter(agreement.values()), {}).get("reference")
    print(f"\nparameters after {args.warmup} warm-up steps, against {reference}:")
    notes = {"local": " (its own batch alone: differs by design)", "initial": " (the weights before the warm-up)"}
    for mode, a in agreement.items():
        if "error" in a:
            print(f"  {mode}: could not gather its parameters: {a['error']}")
            continue
        same = " (bitwise)" if a["bitwise"] else ""
        print(f"  {mode}: max abs diff {a['max_abs_diff']:.3g}{same}{notes.get(mode, '')}")
    verdicts = _verdicts(medians, skipped)
    print()
    for line, _ in verdicts:
        print(line)
    print(f"load average after {load_after[0]:.2f} (1 min), {load_after[1]:.2f} (5 min)")
    payload = {
        "settings": vars(args),
        "model": args.model,
        "params": params,
        "world_size": world,
        "skipped": skipped,
        "median_step_seconds": medians,
        "block_step_seconds": blocks,
        "exposed_comm_seconds": {m: medians[m] - local for m in medians if m != "local" and local is not None},
        "ratio_to_torch_ddp": {m: _ratio(medians, m, "torch-ddp") for m in medians},
        "ratio_to_ddp": {m: _ratio(medians, m, "ddp") for m in medians},
        "targets": TARGETS,
        "verdicts": [{"line": line, "met": met} for line, met in verdicts],
        "agreement": agreement,
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    write_json("bench_zero_speed" if args.model == "mlp" else "bench_zero_speed_gpt", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
