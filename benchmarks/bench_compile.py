"""torch.compile under every strategy: the compiled step against the eager one and against torch's DDP compiled.

    python benchmarks/bench_compile.py                 # 2 processes over gloo, the 10M-parameter MLP, fp32 AdamW
    python benchmarks/bench_compile.py --model gpt     # the small nanoGPT-shaped model (bench_zero_modes.py)
    python benchmarks/bench_compile.py --quick         # few repeats: a smoke run, not a measurement

Each strategy runs twice in the same processes, eagerly and with ``torch.compile(model)`` (inductor) before the
model is wrapped, nanoGPT's order: torch's DistributedDataParallel (the baseline) and paratrain's ddp, zero1,
zero2 and zero3. Under torch's DDP and ours (zero1 and zero2 too) dynamo cuts the compiled graph at about a bucket
of parameters (its DDP optimizer; ddp/compiled_backward.py), so the buckets' collectives overlap the compiled
backward. The modes take turns block by block, the order rotating every round, as bench_zero_speed.py runs them
(whose worker this is); the compile itself happens in the untimed warm-up steps. Target: our compiled ddp step at
or under torch's DDP compiled step on the MLP. A mode that cannot run here is printed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from bench_common import print_table, write_json
from bench_zero_modes import COMPILED, add_model_arguments, default_batch
from bench_zero_speed import run_modes

STRATEGIES = ("torch-ddp", "ddp", "zero1", "zero2", "zero3")


def _ratio(medians: dict[str, float], a: str, b: str) -> float | None:
    return medians[a] / medians[b] if a in medians and b in medians else None


def _cell(value: float | None, unit: str = "x") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=10, help="blocks per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (the compile happens here)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--quick", action="store_true", help="3 blocks of 2 steps: a smoke run")
    parser.add_argument("--out", help="where the JSON goes (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = default_batch(args.model)
    if args.quick:
        args.repeats, args.block = 3, 2
    strategies = [s for s in STRATEGIES if s in args.strategies]
    args.modes = [m for s in strategies for m in (s, s + COMPILED)]
    world = 2
    result = run_modes(args, world, "bench-compile-")
    load_before, load_after = result["load_average_before"], result["load_average_after"]
    blocks: dict[str, list[float]] = result["blocks"]
    skipped: dict[str, str] = result["skipped"]
    agreement: dict[str, dict[str, Any]] = result["agreement"]
    medians = {mode: statistics.median(samples) for mode, samples in blocks.items()}
    baseline = "torch-ddp" + COMPILED
    rows = []
    for s in strategies:
        compiled = s + COMPILED
        eager_ms = "skipped" if s in skipped else f"{medians[s] * 1e3:.1f}"
        compiled_ms = "skipped" if compiled in skipped else f"{medians[compiled] * 1e3:.1f}"
        diff = agreement.get(compiled, {}).get("max_abs_diff")
        rows.append(
            [
                s,
                eager_ms,
                compiled_ms,
                _cell(_ratio(medians, compiled, s)),
                _cell(_ratio(medians, compiled, baseline)),
                "-" if diff is None else f"{diff:.2g}",
            ]
        )
    print(f"world size 2 over gloo, model {args.model}, batch {args.batch} per rank, fp32 AdamW, inductor;")
    print(f"medians of {args.repeats} blocks of {args.block} steps (rank 0); load average {load_before[0]:.2f}\n")
    headers = ["strategy", "eager ms", "compiled ms", "compiled/eager", "vs torch-ddp compiled", "diff vs torch-ddp"]
    print_table(headers, rows)
    for mode, reason in skipped.items():
        print(f"{mode} skipped: {reason}")
    ratio = _ratio(medians, "ddp" + COMPILED, baseline)
    if ratio is None:
        verdict, met = "compiled ddp at or under torch's DDP compiled: cannot tell (a mode skipped)", None
    else:
        met = ratio <= 1.0
        verdict = f"compiled ddp {'at or under' if met else 'SLOWER than'} torch's DDP compiled: {ratio:.3f}x"
    print(f"\n{verdict}")
    print(f"load average after {load_after[0]:.2f} (1 min), {load_after[1]:.2f} (5 min)")
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "modes"},
        "model": args.model,
        "world_size": world,
        "skipped": skipped,
        "median_step_seconds": medians,
        "block_step_seconds": blocks,
        "compiled_over_eager": {s: _ratio(medians, s + COMPILED, s) for s in strategies},
        "ratio_to_torch_ddp_compiled": {m: _ratio(medians, m, baseline) for m in medians},
        "verdict": {"line": verdict, "met": met},
        "agreement": agreement,
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    write_json("bench_compile" if args.model == "mlp" else "bench_compile_gpt", payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
