"""torch.compile before, in place or after ``prepare``, under ddp, zero1, zero2 and zero3 at two ranks: the model
and the clip norms of the same script run eagerly under ddp, bit for bit, with the habits working on the compiled
model and the user's state dict keys (no ``_orig_mod.``); graphs compiled once, graph breaks counted; and a compiled
backward under ddp that lets its buckets' collectives start before it ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compile_scenarios import ORDERS, STRATEGIES, matrix, overlap
from processes import run_ranks

QUICK = ("ddp", "zero3")  # make test: the two engines; make slow adds zero1 and zero2


# dynamo's graph breaks in a run (counted when dynamo compiles, so per distinct forward), per strategy and order
# (docs/compile.md): the data-parallel wrappers' forward is skipped by dynamo (torch's rule for its DDP, which
# breaks twice) and Parallel's forward hook runs eagerly, so ddp, zero1 and zero2 break nowhere; zero3's unit
# hooks run eagerly (torch.compiler.disable, FSDP2's rule) and a traced forward breaks at each unit's hooks it
# meets: a model compiled after prepare, at the root's (this model is one unit)
def most_breaks(strategy: str, order: str) -> int:
    return 1 if (strategy, order) == ("zero3", "after") else 0


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return run_ranks(matrix, 2, tmp_path_factory.mktemp("compile"), QUICK, timeout=600)


@pytest.fixture(scope="module")
def sharded_cells(tmp_path_factory):
    rest = tuple(s for s in STRATEGIES if s not in QUICK)
    return run_ranks(matrix, 2, tmp_path_factory.mktemp("compile-rest"), rest, timeout=600)


def _check(cells: list, strategy: str, order: str) -> None:
    for rank in cells:
        reference, found = rank["ddp/eager"], rank[f"{strategy}/{order}"]
        assert found["keys"] == reference["keys"] and not any("_orig_mod" in k for k in found["keys"]), found["keys"]
        assert found["norms"] == reference["norms"], (found["norms"], reference["norms"])
        assert found["weights"] == reference["weights"]
        graphs = found["graphs"]
        assert graphs[0] > 0, "nothing was compiled: the comparison would be eager against eager"
        assert graphs[1] == graphs[-1], f"compiled again after the second step: graphs by step {graphs}"
        assert found["breaks"] == most_breaks(strategy, order), found["reasons"]


COMPILED = [o for o in ORDERS if o != "eager"]


@pytest.mark.processes
@pytest.mark.parametrize("strategy", QUICK)
@pytest.mark.parametrize("order", COMPILED)
def test_a_compiled_model_trains_the_eager_ddp_model_with_the_habits(cells, strategy, order):
    _check(cells, strategy, order)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in QUICK])
@pytest.mark.parametrize("order", COMPILED)
def test_a_compiled_model_trains_the_eager_ddp_model_under_zero1_and_zero2(sharded_cells, strategy, order):
    _check(sharded_cells, strategy, order)


QUICK_OVERLAP = ("before", "one piece")  # make test; make slow adds in place and after


@pytest.fixture(scope="module")
def overlaps(tmp_path_factory):
    return run_ranks(overlap, 2, tmp_path_factory.mktemp("overlap"), QUICK_OVERLAP, timeout=300)


@pytest.fixture(scope="module")
def other_overlaps(tmp_path_factory):
    rest = tuple(o for o in COMPILED if o not in QUICK_OVERLAP)
    return run_ranks(overlap, 2, tmp_path_factory.mktemp("overlap-rest"), rest, timeout=300)


def _launched_before_the_first_layer(found: dict) -> None:
    events = found["events"]
    assert found["graphs"] > 1, found  # dynamo cut the graph at buckets
    launched = [e for e in events[: events.index("first layer")] if e.startswith("bucket")]
    assert len(launched) >= 3, events  # the last layers' buckets went out while the backward still ran
    assert found["told"] == "", found["told"]


@pytest.mark.processes
def test_a_compiled_backward_launches_buckets_before_it_reaches_the_first_layer(overlaps):
    for rank in overlaps:
        _launched_before_the_first_layer(rank["before"])


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("order", ["in place", "after"])
def test_a_model_compiled_in_place_or_after_prepare_overlaps_too(other_overlaps, order):
    for rank in other_overlaps:
        _launched_before_the_first_layer(rank[order])


@pytest.mark.processes
def test_a_compiled_backward_in_one_piece_is_said_in_one_line(overlaps):
    for rank in overlaps:
        found = rank["one piece"]
        assert found["graphs"] == 1 and found["events"][0] == "first layer", found
        lines = found["told"].splitlines()
        assert len(lines) == 1 and "optimize_ddp is False" in lines[0], lines


# -- nanoGPT's train.py, compile=True, torch's DDP against the one-line swap -------------------------------------

SCRIPT = Path(__file__).parent / "scripts" / "nanogpt_train.py"
TORCH_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP\n"
OUR_IMPORT = "from paratrain import DistributedDataParallel as DDP\n"


def _nanogpt(tmp_path: Path, source: str, name: str, backend: str) -> dict:
    script = tmp_path / f"{name}.py"
    script.write_text(
        source.replace('os.path.dirname(os.path.abspath(__file__)), ".."', repr(str(SCRIPT.parent.parent)))
    )
    out = tmp_path / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    done = subprocess.run(
        [*command, "--compile=True", f"--compile_backend={backend}", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.processes
@pytest.mark.slow  # 30 s with aot_eager, 50 s with inductor: make test's budget has no room for it
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_nanogpt_train_py_compiled_trains_torch_ddps_model_after_the_one_line_swap(tmp_path, backend):
    source = SCRIPT.read_text()
    assert source.count(TORCH_IMPORT) == 1
    theirs = _nanogpt(tmp_path, source, "torch_ddp", backend)
    ours = _nanogpt(tmp_path, source.replace(TORCH_IMPORT, OUR_IMPORT), "paratrain_ddp", backend)
    assert theirs["ddp"].startswith("torch.") and ours["ddp"].startswith("paratrain.")
    assert ours["keys"] == theirs["keys"]  # nanoGPT's raw_model = model.module: torch's compiled wrapper, both
    assert ours["losses"] == theirs["losses"] and ours["norms"] == theirs["norms"]
    assert ours["weights"] == theirs["weights"]
