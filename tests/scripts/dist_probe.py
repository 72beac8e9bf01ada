"""A worker for tests/test_launch.py, started by torchrun: report what torchrun told this process.

python -m torch.distributed.run --nproc-per-node 2 tests/scripts/dist_probe.py OUT_DIR [--exit-code N --exit-rank R]
    [--fail-first-attempt] [--sleep SECONDS]

Each rank joins a gloo process group, all-reduces its rank, and writes OUT_DIR/rank{RANK}.json with the
torchrun variables it saw and the reduced value. --exit-code makes rank R exit with N before joining (the
other ranks exit 0 at once); --fail-first-attempt makes rank 0 exit 5 on torchrun's first attempt only;
--sleep writes OUT_DIR/started{RANK}.json with the process id, then sleeps (for interrupt tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ENV_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--exit-rank", type=int, default=0)
    parser.add_argument("--fail-first-attempt", action="store_true")
    parser.add_argument("--sleep", type=float)
    args, extra = parser.parse_known_args()  # the rest: arguments the test passed through the launcher
    rank = int(os.environ["RANK"])
    if args.exit_code is not None:
        if rank == args.exit_rank:
            print(f"dist_probe: rank {rank} exits with {args.exit_code} on purpose", file=sys.stderr)
            return args.exit_code
        return 0
    if args.sleep is not None:
        (args.out_dir / f"started{rank}.json").write_text(json.dumps({"pid": os.getpid()}))
        time.sleep(args.sleep)
        return 0
    if args.fail_first_attempt and rank == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print("dist_probe: rank 0 fails its first attempt on purpose", file=sys.stderr)
        return 5

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        report = {name: os.environ.get(name) for name in ENV_NAMES}
        report["reduced"] = value.item()
        report["extra"] = extra
        (args.out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
