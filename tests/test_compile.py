"""torch.compile before, in place or after ``prepare``, under ddp, zero1, zero2 and zero3 at two ranks: the model
and the clip norms of the same script run eagerly under ddp, bit for bit, with the habits working on the compiled
model and the user's state dict keys (no ``_orig_mod.``)."""

from __future__ import annotations

import pytest

from compile_scenarios import ORDERS, STRATEGIES, matrix
from processes import run_ranks

pytestmark = pytest.mark.processes


QUICK = ("ddp", "zero3")  # make test: the two engines; make slow adds zero1 and zero2


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


COMPILED = [o for o in ORDERS if o != "eager"]


@pytest.mark.parametrize("strategy", QUICK)
@pytest.mark.parametrize("order", COMPILED)
def test_a_compiled_model_trains_the_eager_ddp_model_with_the_habits(cells, strategy, order):
    _check(cells, strategy, order)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in QUICK])
@pytest.mark.parametrize("order", COMPILED)
def test_a_compiled_model_trains_the_eager_ddp_model_under_zero1_and_zero2(sharded_cells, strategy, order):
    _check(sharded_cells, strategy, order)
