"""Users' habits against every strategy (issue 25): each cell trains the same model as its reference or is refused
with the words tests/habits.py expects, and docs/sharding.md shows the same table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import clip_exactness
import habits

SCRIPTS = Path(__file__).parent / "scripts"
DOCS = Path(__file__).parents[1] / "docs" / "sharding.md"


def _check(cell: dict, expected: str, where: str, reference: torch.Tensor | None, exact: bool) -> None:
    if expected != habits.SAME:
        assert "refused" in cell, f"{where}: expected a refusal with {expected!r}, trained instead"
        assert expected in cell["refused"], f"{where}: {cell['refused']}"
        return
    assert "weights" in cell, f"{where}: expected the same model, found {cell.get('refused')}"
    if reference is None:
        return
    weights = torch.tensor(cell["weights"])
    if exact:
        assert torch.equal(weights, reference), f"{where}: max |diff| {float((weights - reference).abs().max()):.3g}"
    else:
        assert torch.allclose(weights, reference, rtol=1e-5, atol=1e-6), (
            f"{where}: max |diff| {float((weights - reference).abs().max()):.3g}"
        )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    directory = tmp_path_factory.mktemp("habits-one")
    return {
        name: {
            strategy: habits.run(name, strategy, directory, devices)
            for strategy, devices in (("single", "cpu"), ("dp", "cpu,cpu"))
        }
        for name in habits.HABITS
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("habits-launched")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "habit_matrix.py"), str(out)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=out
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    found = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r, cells in enumerate(found):
        cells["clip"] = json.loads((out / f"clip-rank-{r}.json").read_text())
    return found


@pytest.mark.parametrize("name", list(habits.HABITS))
def test_single_and_dp(one_process, name):
    cells, expected = one_process[name], habits.EXPECTED[name]
    _check(cells["single"], expected["single"], "single", None, exact=True)
    reference = torch.tensor(cells["single"]["weights"]) if "weights" in cells["single"] else None
    _check(cells["dp"], expected["dp"], "dp", reference, exact=False)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(habits.HABITS))
def test_ddp_and_the_zero_stages_in_one_launch(one_process, launched, name):
    """ddp against one device (fp32 summation order), zero1, zero2 and zero3 against ddp bit for bit (2 ranks), on
    both ranks; a refusal on the rank that makes the call (rank 0 for a main-only save or evaluation)."""
    expected = habits.EXPECTED[name]
    single = one_process[name]["single"]
    reference = torch.tensor(single["weights"]) if "weights" in single else None
    for rank, found in enumerate(launched):
        cells = found[name]
        main_only = habits.HABITS[name] in (
            habits.save_on_main_only,
            habits.eval_on_main_only,
            habits.state_dict_on_main_only,
        )
        _check(cells["ddp"], expected["ddp"], f"rank {rank} ddp", reference, exact=False)
        ddp = torch.tensor(cells["ddp"]["weights"]) if "weights" in cells["ddp"] else None
        for strategy in ("zero1", "zero2", "zero3"):
            want = expected[strategy] if rank == 0 or not main_only else habits.SAME
            _check(cells[strategy], want, f"rank {rank} {strategy}", ddp, exact=True)


@pytest.mark.processes
@pytest.mark.parametrize("strategy", clip_exactness.STRATEGIES)
def test_par_clip_grad_norm_is_torchs_clip_on_torchs_ddp_bit_for_bit(launched, strategy):
    """20 AdamW steps, every one clipped: each step's norm and the final weights are those of
    torch.nn.utils.clip_grad_norm_(model.parameters()) on torch's DDP (a float64 sum differed on 6 steps of 20)."""
    for rank, found in enumerate(launched):
        clip = found["clip"]
        assert clip["clipped_steps"] == clip["steps"], clip  # every step clipped: the coefficient matters
        r = clip[strategy]
        assert r["same_norms"] == clip["steps"] and r["bitwise"], f"rank {rank}: {r}"
        if strategy == "zero2":  # from the second step on, measured as each bucket was reduced: no extra gather
            assert r["measured_in_backward"] == clip["steps"] - 1, r


def test_the_docs_show_the_matrix():
    fix = "paste the output of `cd tests && python -c 'import habits; print(habits.table())'`"
    assert habits.table() in DOCS.read_text(), f"docs/sharding.md does not show the matrix: {fix}"
