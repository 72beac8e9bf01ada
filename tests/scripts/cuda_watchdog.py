"""One nccl rank on cuda:0 (run by tests/test_cuda.py): ``python cuda_watchdog.py STORE_FILE``.

1. A backward whose gradient all-reduce is queued behind a second of GPU work returns to the host at once: the
   host does not wait for the all-reduce (no ``Work.wait(timeout)`` spinning each step).
2. One queued behind 20 s of GPU work, with ``timeout=2``, is overdue: the watchdog (the board's thread) reports it
   on stderr and ends the process with exit code 1 long before the GPU work ends.

Prints one JSON line per stage; "survived" means the watchdog did not act.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from paratrain import DistributedDataParallel


def _cycles_per_second() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) / 1e3)


def main(store_file: str) -> None:
    dist.init_process_group("nccl", store=dist.FileStore(store_file, 1), rank=0, world_size=1)
    model = DistributedDataParallel(torch.nn.Linear(64, 8).cuda(), device_ids=[0], timeout=2.0)
    x = torch.randn(32, 64, device="cuda")
    model(x).sum().backward()
    torch.cuda.synchronize()
    rate = _cycles_per_second()

    torch.cuda._sleep(int(1.0 * rate))
    start = time.monotonic()
    model(x).sum().backward()
    host = time.monotonic() - start
    torch.cuda.synchronize()
    print(json.dumps({"host_seconds": host, "gpu_seconds": time.monotonic() - start}), flush=True)

    torch.cuda._sleep(int(20.0 * rate))
    print(json.dumps({"stalled_at": time.time()}), flush=True)
    model(x).sum().backward()
    torch.cuda.synchronize()  # the watchdog ends the process before the GPU gets here
    print(json.dumps({"survived": time.time()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
