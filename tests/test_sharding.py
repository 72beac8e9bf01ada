"""How a bucket is split across ranks: equal parts, padding at the end, parameters straddling parts."""

from __future__ import annotations

import pytest
import torch

from paratrain.ddp.buckets import Bucket
from paratrain.errors import ConfigError
from paratrain.sharded.partition import Piece, alignment, part_size, shard_bucket


def _bucket(numels: list[int], dtype: torch.dtype = torch.float32) -> Bucket:
    """Parameters 0..k-1 laid out back to back in that order."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    return Bucket(0, tuple(range(len(numels))), tuple(offsets), total, dtype, torch.device("cpu"))


@pytest.mark.parametrize(
    "numel, world, align, part",
    [
        (0, 4, 4, 0),
        (1, 1, 1, 1),
        (10, 2, 1, 5),
        (11, 2, 1, 6),  # the second part ends in one element of padding
        (10, 3, 4, 4),  # three parts of one alignment unit each: 12 elements, 2 of them padding
        (100, 4, 4, 28),
        (1024, 4, 4, 256),
        (5, 4, 1, 2),  # parts 2, 2, 1, 0 real elements: the last rank holds padding only
    ],
)
def test_part_sizes(numel, world, align, part):
    assert part_size(numel, world, align) == part
    assert part * world >= numel and (part * world - numel) < world * align + align


def test_alignment_is_16_bytes():
    assert [alignment(d) for d in (torch.float32, torch.bfloat16, torch.float64, torch.int8)] == [4, 8, 2, 16]


def test_bad_sizes_are_refused():
    with pytest.raises(ConfigError, match="world_size must be at least 1"):
        part_size(10, 0)


# three parameters of 5, 7 and 4 elements (16 in all) over 3 ranks with an alignment of 2: parts of 6
#   element:  0 . . . . 5 . . . . . . 12 . . 15 | padding 16, 17
#   params:   [ p0: 5  ][    p1: 7    ][ p2: 4 ]
#   ranks:    [  rank 0  ][  rank 1  ][ rank 2 ]
#             0        5 6        11 12    17
@pytest.mark.parametrize(
    "rank, pieces",
    [
        (0, [Piece(0, 0, 5, 0), Piece(1, 0, 1, 5)]),  # p1 straddles ranks 0 and 1
        (1, [Piece(1, 1, 6, 0)]),
        (2, [Piece(2, 0, 4, 0)]),
    ],
)
def test_pieces_of_each_rank(rank, pieces):
    shards = shard_bucket(_bucket([5, 7, 4]), [5, 7, 4], world_size=3, align=2)
    assert shards.part == 6 and shards.padded == 18 and shards.world_size == 3
    assert list(shards.pieces[rank]) == pieces
    assert [shards.real(r) for r in range(3)] == [6, 6, 4]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_element_is_owned_once_and_parts_are_equal(world):
    numels = [3, 1000, 17, 1, 250, 64]
    shards = shard_bucket(_bucket(numels), numels, world)
    owned: dict[int, list[tuple[int, int]]] = {}
    for r, mine in enumerate(shards.pieces):
        assert sum(p.length for p in mine) == shards.real(r)
        offsets = [p.offset for p in mine]
        assert offsets == sorted(offsets) and all(0 <= o < shards.part for o in offsets)
        for piece in mine:
            owned.setdefault(piece.param, []).append((piece.start, piece.length))
    for index, n in enumerate(numels):
        ranges = sorted(owned[index])
        at = 0
        for start, length in ranges:
            assert start == at
            at += length
        assert at == n
    assert shards.padded - shards.numel < world * alignment(torch.float32)
