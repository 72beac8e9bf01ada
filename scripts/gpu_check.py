"""The device check: everything that needs a GPU, in one call, for a session that is lent one.

    python scripts/gpu_check.py            # CUDA tests, then the GPU benchmarks; figures land in $OUT or results/
    python scripts/gpu_check.py --quick    # the tests and smoke-sized benchmarks

On the lent GPU machine (its python3 already holds torch with CUDA, pytest, numpy and tqdm), from the
repository root, as one command through the device tool:
    PYTHONPATH=src python3 scripts/gpu_check.py --out "$OUT"
It prints a summary per step and writes each benchmark's JSON next to it; a failing step does not stop the
others, and the exit code says whether any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(label: str, command: list[str], timeout: float) -> bool:
    print(f"\n=== {label}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(command, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"=== {label}: timed out after {timeout:.0f}s", flush=True)
        return False
    print(f"=== {label}: exit {code} in {time.monotonic() - start:.0f}s", flush=True)
    return code == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the JSON files go")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    steps = [
        ("env", [py, "-m", "paratrain", "env"], 60),
        (
            "cuda tests",
            [py, "-m", "pytest", "-q", "-s", "tests/test_cuda.py", "tests/test_checkpoint.py", "-k", "cuda"],
            300,
        ),
        (
            "dp benchmark",
            [py, "benchmarks/bench_data_parallel.py", "--gpu", *quick, "--out", str(out / "data_parallel_gpu.json")],
            300,
        ),
        ("ddp benchmark", [py, "benchmarks/bench_ddp.py", "--gpu", *quick, "--out", str(out / "ddp_gpu.json")], 240),
        (
            "precision benchmark",
            [py, "benchmarks/bench_precision.py", "--gpu", *quick, "--out", str(out / "precision_gpu.json")],
            180,
        ),
        (
            "train benchmark",
            [
                py,
                "benchmarks/bench_train.py",
                "--device",
                "cuda",
                "--epochs",
                "1",
                "--repeats",
                "1" if args.quick else "3",
                "--out",
                str(out / "train_gpu.json"),
            ],
            400,
        ),
        (
            "train ddp on the gpu",
            [
                py,
                "-m",
                "paratrain",
                "train",
                "--strategy",
                "ddp",
                "--nproc-per-node",
                "1",
                "--quiet",
                "--metrics-out",
                str(out / "train_ddp_gpu.json"),
            ],
            180,
        ),
        (
            "train zero1 on the gpu",
            [
                py,
                "-m",
                "paratrain",
                "train",
                "--strategy",
                "zero1",
                "--nproc-per-node",
                "1",
                "--quiet",
                "--metrics-out",
                str(out / "train_zero1_gpu.json"),
            ],
            180,
        ),
        (
            "train zero2 on the gpu",
            [
                py,
                "-m",
                "paratrain",
                "train",
                "--strategy",
                "zero2",
                "--nproc-per-node",
                "1",
                "--quiet",
                "--metrics-out",
                str(out / "train_zero2_gpu.json"),
            ],
            180,
        ),
        (
            "train zero3 on the gpu",
            [
                py,
                "-m",
                "paratrain",
                "train",
                "--strategy",
                "zero3",
                "--nproc-per-node",
                "1",
                "--quiet",
                "--metrics-out",
                str(out / "train_zero3_gpu.json"),
            ],
            180,
        ),
        (
            "zero memory on the gpu (torch.cuda.max_memory_allocated)",
            [
                py,
                "benchmarks/bench_zero_memory.py",
                "--models",
                "mlp 10M",
                "--min-world-size",
                "1",
                "--max-world-size",
                "1",
                "--out",
                str(out / "zero_memory_gpu.json"),
            ],
            240,
        ),
    ]
    results = {label: run(label, command, timeout) for label, command, timeout in steps}
    print("\n=== summary")
    for label, ok in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {label}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
