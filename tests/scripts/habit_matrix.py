"""Every habit of tests/habits.py under ddp, zero1, zero2 and zero3, one Parallel per cell, in one launch; each rank
writes what each cell gave to OUT/rank-R.json, and par.clip_grad_norm_ against torch's clip on torch's DDP
(tests/clip_exactness.py) to OUT/clip-rank-R.json.

    torchrun --standalone --nproc-per-node 2 habit_matrix.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the habits

import clip_exactness
import habits


def main() -> int:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    found = {
        name: {strategy: habits.run(name, strategy, out) for strategy in habits.PROCESS_STRATEGIES}
        for name in habits.HABITS
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(found))
    (out / f"clip-rank-{rank}.json").write_text(json.dumps(clip_exactness.against_torch(rank)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
