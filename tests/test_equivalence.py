"""zero1, zero2 and zero3 against ddp across the equivalence matrix (tests/equivalence.py), two ranks over gloo.

``make test`` runs the pairwise cover (every pair of factors meets at least once); ``make slow`` the full product.
In every cell rank 1 sleeps before each step, so the other rank's step and the reads after it run ahead of it.
"""

from __future__ import annotations

import pytest

from equivalence import BUCKETS, HABITS, MODELS, PRECISIONS, Cell, full_product, pairwise, pairwise_cover, product
from processes import run_ranks

pytestmark = pytest.mark.processes


def test_the_pairwise_cover_meets_every_pair_of_factors_and_is_smaller_than_the_product():
    cells = pairwise_cover()
    factors = (PRECISIONS, MODELS, BUCKETS, HABITS)
    for i in range(len(factors)):
        for j in range(i + 1, len(factors)):
            for a in factors[i]:
                for b in factors[j]:
                    assert any(
                        (cell.precision, cell.model, cell.buckets, cell.habit)[i] == a
                        and (cell.precision, cell.model, cell.buckets, cell.habit)[j] == b
                        for cell in cells
                    ), (a, b)
    assert len(cells) < len(full_product()) == 3 * 4 * 2 * 3
    assert Cell("16-mixed", "block", "per-parameter", "clip") in full_product()


def _check(results: list[dict]) -> None:
    for rank in results:
        for cell, row in rank.items():
            for strategy, found in row.items():
                assert "refused" not in found, (cell, strategy, found)
                assert found["moved"] > 1e-3, (cell, found)  # training changed the weights: the match means something
                assert found["bitwise"], (cell, strategy, found["gaps"], found["skipped"])


def test_every_sharded_strategy_trains_ddps_model_bit_for_bit_in_every_pair_of_factors(tmp_path):
    _check(run_ranks(pairwise, 2, tmp_path, timeout=600))


@pytest.mark.slow
def test_every_sharded_strategy_trains_ddps_model_bit_for_bit_in_the_full_product(tmp_path):
    _check(run_ranks(product, 2, tmp_path, timeout=1800))
