"""How a bucket's flat buffer is split across ranks: a pure function of the bucket and the world size, table-tested.

The sharded strategies (``zero1``, ``zero2``) keep each gradient bucket of :mod:`paratrain.ddp.buckets` as one flat
buffer per dtype and split it into ``world_size`` equal parts, rank ``r`` owning part ``r``. A part is a multiple
of :func:`alignment` elements (16 bytes), the buffer is padded at its end to ``world_size`` parts, and a parameter
is free to straddle two (or more) ranks' parts. Each rank's share of a parameter is a :class:`Piece`: a contiguous
range of the flattened parameter, which is what the rank's optimizer state and checkpoint slices cover::

    shards = shard_bucket(bucket, numels, world_size=4)
    shards.part                      # elements of every rank's part (the padded buffer holds 4 of them)
    shards.pieces[1]                 # rank 1's pieces: (parameter index, its first element, length, offset)

The pieces depend on the parameters' sizes, their order in the bucket and the world size only; a checkpoint
records parameters as whole flattened ranges, so it never depends on them (see :mod:`paratrain.checkpoint.sharded`).
Sharding the weights themselves (ZeRO-3) keeps the same parts: the weights of part ``r`` live on rank ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paratrain.ddp.buckets import Bucket
from paratrain.errors import ConfigError

__all__ = ["ALIGN_BYTES", "BucketShards", "Piece", "alignment", "part_size", "shard_bucket"]

ALIGN_BYTES = 16  # every part starts 16 bytes apart from the buffer's start: what nccl's fast paths want


@dataclass(frozen=True)
class Piece:
    """One rank's share of one parameter: elements ``[start, start + length)`` of the flattened parameter."""

    param: int  # the parameter's position in the list the buckets were built from
    start: int  # its first element this rank holds
    length: int
    offset: int  # where that element sits in the rank's part of the bucket


@dataclass(frozen=True)
class BucketShards:
    """A bucket split into ``world_size`` parts of ``part`` elements; ``pieces[r]`` is what rank ``r`` owns."""

    bucket: int
    numel: int  # the bucket's real elements (the rest of world_size * part is padding, at the end)
    part: int
    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.pieces)

    @property
    def padded(self) -> int:
        """Elements of the padded flat buffer: every rank's part, back to back."""
        return self.part * self.world_size

    def real(self, rank: int) -> int:
        """How many of rank ``rank``'s part are real elements (the last ranks' parts may end in padding)."""
        return max(0, min(self.part, self.numel - rank * self.part))


def alignment(dtype: torch.dtype) -> int:
    """Elements per alignment unit of ``dtype``: a part is a whole number of them."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def part_size(numel: int, world_size: int, align: int = 1) -> int:
    """Elements of each of ``world_size`` equal parts covering ``numel``, rounded up to ``align``."""
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1; found {world_size}")
    if align < 1:
        raise ConfigError(f"align must be at least 1; found {align}")
    units = -(-numel // align)  # ceil: whole alignment units
    return -(-units // world_size) * align


def shard_bucket(bucket: Bucket, numels: Sequence[int], world_size: int, align: int | None = None) -> BucketShards:
    """Split ``bucket`` (parameters of ``numels`` elements each, indexed as in ``bucket.indices``) across ranks.

    ``align`` defaults to :func:`alignment` of the bucket's dtype.
    """
    unit = alignment(bucket.dtype) if align is None else align
    part = part_size(bucket.numel, world_size, unit)
    pieces: list[tuple[Piece, ...]] = []
    for rank in range(world_size):
        lo, hi = rank * part, min((rank + 1) * part, bucket.numel)
        mine = []
        for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
            begin, end = max(offset, lo), min(offset + numels[index], hi)
            if begin < end:
                mine.append(Piece(index, begin - offset, end - begin, begin - lo))
        pieces.append(tuple(mine))
    return BucketShards(bucket.index, bucket.numel, part, tuple(pieces))
