"""benchmarks/bench_memory_cap.py: the cap bites where it should; zero3 trains at N = 2 under a cap ddp cannot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_memory_cap as cap_bench

MIB = 2**20


def test_an_allocation_past_the_cap_fails_with_the_allocators_out_of_memory_error(restored_limit: None) -> None:
    cap_bench.cap_memory(64 * MIB)
    try:
        within = torch.empty(16 * MIB, dtype=torch.uint8)  # under the cap: granted
        with pytest.raises(RuntimeError) as caught:
            torch.empty(256 * MIB, dtype=torch.uint8)  # past it: a mapping of its own, refused
    finally:
        cap_bench.lift_cap()
    assert cap_bench.is_oom(caught.value)
    said = cap_bench.short(cap_bench.first_line(caught.value))
    assert said == f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {256 * MIB} bytes", said
    assert within.numel() == 16 * MIB
    assert torch.empty(256 * MIB, dtype=torch.uint8).numel() == 256 * MIB  # lifted


def test_a_run_fails_by_its_out_of_memory_rank_not_by_the_rank_that_lost_its_peer() -> None:
    ranks = [
        {"rank": 0, "trained": False, "steps": 0, "oom": False, "error": "DistBackendError: Connection closed by peer"},
        {"rank": 1, "trained": False, "steps": 0, "oom": True, "error": "RuntimeError: ... can't allocate memory"},
    ]
    ranks[1]["phase"] = "prepare"
    outcome = cap_bench.summary("ddp", 64 * MIB, ranks)
    assert outcome["oom"] and not outcome["trained"]
    assert (outcome["error_rank"], outcome["phase"]) == (1, "prepare")
    assert not cap_bench.is_oom(RuntimeError("Connection closed by peer")) and cap_bench.is_oom(MemoryError())


@pytest.mark.processes
def test_zero3_trains_at_two_ranks_under_a_cap_that_ddp_cannot_train_under() -> None:
    # 4.3M parameters: 16Ψ = 66 MiB whole (ddp trains from about 85 MiB), 16Ψ/2 = 33 MiB (zero3 from about 55)
    spec = (784, 512, 16)
    cap = 70 * MIB
    ddp = cap_bench.summary("ddp", cap, cap_bench.run("ddp", cap, spec))
    zero3 = cap_bench.summary("zero3", cap, cap_bench.run("zero3", cap, spec))
    assert ddp["oom"] and not ddp["trained"], ddp
    assert "can't allocate memory" in ddp["error"]
    assert zero3["trained"] and zero3["steps"] == cap_bench.STEPS, zero3
    assert zero3["final_loss"] is not None and zero3["peak_bytes"] < cap
