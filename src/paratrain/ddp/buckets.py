"""Which gradients share an all-reduce bucket: a pure function of the parameters, table-tested.

Gradients are averaged in flat buckets rather than one collective per parameter (too many small messages) or
one for the whole model (no overlap with backward). Parameters are taken in reverse registration order, the
order in which backward usually produces their gradients, so the first bucket fills early and its all-reduce
overlaps with the rest of backward. That first bucket is small (it closes at 1 MB) to start communication sooner.

    buckets = assign_buckets(list(model.parameters()), cap_bytes=25 * 2**20)
    buckets[0].indices        # positions in the parameter list, e.g. (7, 6) for the last layer's bias and weight
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paratrain.errors import ConfigError

__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "assign_buckets"]

FIRST_BUCKET_BYTES = 1024 * 1024  # the first bucket of each dtype: small, so communication starts early


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: parameters of one dtype and device, laid out back to back in a flat buffer."""

    index: int
    indices: tuple[int, ...]  # positions in the parameter list, in the order they sit in the buffer
    offsets: tuple[int, ...]  # where each one starts in the buffer, in elements
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def assign_buckets(
    params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[Bucket]:
    """Group ``params`` into buckets that close as soon as they hold ``cap_bytes`` (torch's reducer's rule).

    A bucket takes each next parameter and closes once it reaches its cap, so it may pass the cap by its last
    tensor: the buckets torch's DDP builds, and the cuts dynamo makes in a compiled graph (which cuts at graph
    nodes, a layer's weight and bias together: a bucket that closed before its cap would wait for the next piece
    of a compiled backward). One dtype and device per bucket (an all-reduce needs one flat buffer of one type).
    Within each (dtype, device) group the first bucket's cap is ``min(first_cap_bytes, cap_bytes)``. Buckets are
    numbered in the order they close while walking the parameters in reverse, which is the order every rank
    launches them in.
    """
    if cap_bytes <= 0:
        raise ConfigError(f"bucket_cap_mb must be positive; found a cap of {cap_bytes} bytes")
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []

    def limit(key: tuple[torch.dtype, torch.device]) -> int:
        return min(first_cap_bytes, cap_bytes) if closed_count.get(key, 0) == 0 else cap_bytes

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        closed.append(open_buckets.pop(key))
        open_bytes.pop(key)
        closed_count[key] = closed_count.get(key, 0) + 1

    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + size
        if open_bytes[key] >= limit(key):
            close(key)
    for key in list(open_buckets):
        close(key)

    buckets = []
    for index, members in enumerate(closed):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        first = params[members[0]]
        buckets.append(Bucket(index, tuple(members), tuple(offsets), total, first.dtype, first.device))
    return buckets
