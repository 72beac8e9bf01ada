"""Time all-reduces of a few sizes with real processes: the link measurements of ``paratrain plan``.

    paratrain launch --nproc-per-node 3 -m paratrain.tools.allreduce_probe link.json
    # two machines: the link between them, for `paratrain plan --link-file link.json`
    paratrain launch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 10.0.0.1:29400 \
        -m paratrain.tools.allreduce_probe link.json

Every rank runs it; gloo on the CPU, nccl with GPUs. For each group size from 2 to the world size (the first n
ranks) and each message size, rank 0 records the median seconds of a few all-reduces started together (after a
barrier), and writes ``{"samples": [[world_size, bytes, seconds], ...], "backend": ...}`` to the file.

In a training step the ranks do not arrive together: each computes first, and on a machine whose cores are
shared (by the processes, or other jobs) some rank is late. With ``--bursts FILE`` (``{"2": units, ...}``:
work units per group size, calibrated by the caller to last as long as that world size's forward and
backward), it also times each rank computing its burst and then a 4-byte all-reduce, against the burst alone:
the difference is the synchronisation cost of a step, ``"sync": {"2": seconds, ...}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.environment import ClusterEnvironment

__all__ = ["DEFAULT_SIZES", "main", "measure", "measure_sync", "work_unit"]

DEFAULT_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 25)  # 64 KiB .. 32 MiB: DDP's first bucket is 1 MiB, the cap 25
_WARMUP = 2
_REPEATS = 7


def measure(sizes: tuple[int, ...], device: torch.device) -> list[list[float]]:
    """``[world_size, bytes, median seconds]`` per group size and message size, on every rank (rank 0's timings)."""
    world = dist.get_world_size()
    samples: list[list[float]] = []
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n))) if n < world else dist.group.WORLD  # every rank must call new_group
        member = dist.get_rank() < n
        for nbytes in sizes:
            buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            times = []
            for i in range(_WARMUP + _REPEATS):
                dist.barrier()
                if not member:
                    continue
                start = time.perf_counter()
                dist.all_reduce(buffer, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= _WARMUP:
                    times.append(time.perf_counter() - start)
            if member:
                samples.append([n, nbytes, statistics.median(times)])
    return samples


def work_unit(device: torch.device) -> Callable[[], None]:
    """A small piece of compute (matrix products) that burst lengths are counted in."""
    a = torch.randn(96, 96, device=device)

    def unit() -> None:
        b = a
        for _ in range(4):
            b = torch.mm(b, a).tanh_()

    return unit


def measure_sync(bursts: dict[int, int], device: torch.device) -> dict[str, float]:
    """Per group size: what a step of (burst, 4-byte all-reduce) costs more than a step of burst alone.

    The steps run back to back, as training steps do (a barrier before each would let the ranks start together,
    and a process that sleeps at every barrier is woken sooner than one that computes all the time), alternating
    with and without the all-reduce; the median of each adjacent pair's difference is robust to the load of a
    shared machine drifting during the measurement.
    """
    world = dist.get_world_size()
    unit = work_unit(device)
    tiny = torch.zeros(1, device=device)
    sync: dict[str, float] = {}
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n))) if n < world else dist.group.WORLD
        member = dist.get_rank() < n
        units = bursts.get(n, 0)
        dist.barrier()
        if not member:
            continue
        differences = []
        for i in range(_WARMUP + 3 * _REPEATS):
            pair = []
            for with_reduce in (False, True):
                start = time.perf_counter()
                for _ in range(units):
                    unit()
                if with_reduce:
                    dist.all_reduce(tiny, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                pair.append(time.perf_counter() - start)
            if i >= _WARMUP:
                differences.append(pair[1] - pair[0])
        sync[str(n)] = max(0.0, statistics.median(differences))
    return sync


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    rest = argv[1:]
    bursts: dict[int, int] = {}
    if rest[:1] == ["--bursts"]:
        bursts = {int(k): int(v) for k, v in json.loads(Path(rest[1]).read_text()).items()}
        rest = rest[2:]
    sizes = tuple(int(s) for s in rest) or DEFAULT_SIZES
    use_cuda = torch.cuda.is_available()
    local_rank = ClusterEnvironment.detect().local_rank
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        samples = measure(sizes, device)
        sync = measure_sync(bursts, device) if bursts else {}
        if dist.get_rank() == 0:
            out.write_text(json.dumps({"samples": samples, "sync": sync, "backend": dist.get_backend()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
