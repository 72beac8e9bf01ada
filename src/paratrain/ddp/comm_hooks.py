"""Communication hooks: how one gradient bucket is averaged across ranks.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: it starts the communication for
``bucket.buffer()`` (the flat, not yet averaged gradients) and returns a future whose value is the averaged
buffer. The default is a plain all-reduce; the compression hooks halve the bytes on the wire by sending
fp16 or bf16 and casting back, at the cost of precision.

    ddp.register_comm_hook(None, fp16_compress_hook)       # state: the process group (None: the default)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommHook", "GradBucket", "bf16_compress_hook", "fp16_compress_hook"]


class GradBucket:
    """What a hook sees of one bucket: its flat buffer and the parameters whose gradients it holds."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.Tensor],
        gradients: list[torch.Tensor],
        is_last: bool,
        world_size: int,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._gradients = gradients
        self._is_last = is_last
        self.world_size = world_size

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (the sum has not been taken, nor the mean)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents (torch's GradBucket method, used by some of torch's hooks)."""
        self._buffer.copy_(tensor)

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """Views into :meth:`buffer`, one per parameter, shaped like it."""
        return self._gradients

    def is_last(self) -> bool:
        return self._is_last


CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def _group(state: Any) -> Any:
    return state if state is not None else dist.group.WORLD


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(bucket.world_size)
        work = dist.all_reduce(compressed, group=_group(state), async_op=True)
        assert work is not None

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        done: torch.futures.Future[torch.Tensor] = work.get_future().then(decompress)
        return done

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_compress_hook"
    return hook


fp16_compress_hook: CommHook = _compress_hook(torch.float16)
fp16_compress_hook.__doc__ = "Send the bucket as float16 (half the bytes), average, and cast back."
bf16_compress_hook: CommHook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "Send the bucket as bfloat16 (half the bytes, float32's range), average, and cast back."
