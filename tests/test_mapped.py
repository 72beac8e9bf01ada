"""paratrain.checkpoint.mapped: a torch file's tensors as views of a read-only mapping, which a data cap leaves
alone, where torch.load(mmap=True)'s private writable mapping counts the whole file against RLIMIT_DATA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from paratrain.checkpoint.lazy_weights import open_weights
from paratrain.checkpoint.mapped import load_mapped

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_memory_cap as cap_bench

MIB = 2**20


def test_the_tensors_are_torch_loads_views_and_shared_storage_included(tmp_path: Path) -> None:
    w = torch.randn(6, 4)
    state = {"a": w, "t": w.t(), "tail": w[2:], "nested": {"i": torch.arange(5)}, "empty": torch.empty(0)}
    state["half"] = torch.randn(3).half()
    torch.save(state, tmp_path / "s.pt")
    mapped = load_mapped(tmp_path / "s.pt")
    for key in ("a", "t", "tail", "empty", "half"):
        assert torch.equal(mapped[key], state[key]) and mapped[key].dtype == state[key].dtype, key
    assert torch.equal(mapped["nested"]["i"], state["nested"]["i"])
    assert mapped["t"].stride() == state["t"].stride()


def test_a_file_larger_than_the_cap_maps_read_only_where_torch_loads_mapping_is_refused(
    tmp_path: Path, restored_limit: None
) -> None:
    weights = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(16)}  # 64 MiB
    torch.save(weights, tmp_path / "big.pt")
    del weights
    cap_bench.cap_memory(32 * MIB)
    try:
        with pytest.raises(RuntimeError, match="Cannot allocate memory"):
            torch.load(tmp_path / "big.pt", mmap=True, weights_only=True)  # MAP_PRIVATE, writable: counted whole
        mapped = load_mapped(tmp_path / "big.pt")
        total = sum(float(t[0, 0]) for t in mapped.values())  # a page of each: read from the mapping
        opened = open_weights(tmp_path / "big.pt", list(mapped))
        part = opened.state["w15"].reshape(-1)[-3:].clone()  # a view of the mapping, copied from
    finally:
        cap_bench.lift_cap()
    assert total == sum(range(16))
    assert opened.what == "torch state dict" and opened.tensors == 16 and part.tolist() == [15.0] * 3
