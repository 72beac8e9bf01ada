"""Turn what users write for devices (``0``, ``"cuda:1"``, ``"cpu"``, ``torch.device``) into checked devices."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paratrain.errors import DeviceError

__all__ = ["DeviceLike", "parse_device", "parse_device_list", "parse_devices_arg", "visible_gpus"]

DeviceLike = int | str | torch.device

SUPPORTED_TYPES = ("cpu", "cuda")


def visible_gpus() -> list[torch.device]:
    """Every CUDA device this process can see, in index order."""
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def parse_device(spec: DeviceLike, *, what: str = "device") -> torch.device:
    """One device, checked to exist: ints are CUDA indices, ``-1`` is the CPU (as in torch's gather)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, str, torch.device)):
        raise DeviceError(
            f"{what} must be an int, a string such as 'cuda:0' or 'cpu', or a torch.device; "
            f"found {type(spec).__name__} {spec!r}"
        )
    if isinstance(spec, int):
        device = torch.device("cpu") if spec == -1 else _cuda(spec, what)
    elif isinstance(spec, str):
        text = spec.strip()
        if text.isdigit():
            device = _cuda(int(text), what)
        else:
            try:
                device = torch.device(text)
            except RuntimeError as exc:
                raise DeviceError(
                    f"{what} {spec!r} is not a device; expected 'cpu', 'cuda', 'cuda:N' or an index N"
                ) from exc
    else:
        device = spec
    if device.type not in SUPPORTED_TYPES:
        raise DeviceError(f"{what} {device} has type {device.type!r}; paratrain supports {SUPPORTED_TYPES}")
    if device.type == "cuda":
        index = device.index if device.index is not None else _current_cuda_index(what)
        device = _cuda(index, what)
    return device


def _current_cuda_index(what: str) -> int:
    _require_cuda(what, "cuda")
    return torch.cuda.current_device()


def _require_cuda(what: str, spec: object) -> None:
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{what} {spec!r} asks for a GPU, but no CUDA device is visible (torch.cuda.is_available() is "
            f"False); use 'cpu' (several 'cpu' entries give CPU replicas) or run on a machine with a GPU"
        )


def _cuda(index: int, what: str) -> torch.device:
    if index < 0:
        raise DeviceError(f"{what} index {index} is negative; GPU indices start at 0 (-1 means the CPU)")
    _require_cuda(what, f"cuda:{index}")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"{what} cuda:{index} does not exist: {count} GPU(s) are visible (cuda:0..cuda:{count - 1}); "
            f"check CUDA_VISIBLE_DEVICES or pick an index below {count}"
        )
    return torch.device("cuda", index)


def parse_device_list(specs: Sequence[DeviceLike] | None, *, what: str = "device_ids") -> list[torch.device]:
    """A non-empty list of devices of one type; ``None`` means every visible GPU (possibly none)."""
    if specs is None:
        return visible_gpus()
    if isinstance(specs, (str, int, torch.device)):
        raise DeviceError(f"{what} must be a list such as [0, 1] or ['cpu', 'cpu']; found {specs!r}")
    devices = [parse_device(s, what=f"{what}[{i}]") for i, s in enumerate(specs)]
    if not devices:
        raise DeviceError(
            f"{what} is empty; pass None for every visible GPU, or a list such as [0, 1] or ['cpu', 'cpu']"
        )
    types = sorted({d.type for d in devices})
    if len(types) > 1:
        raise DeviceError(f"{what} mixes device types {types}; replicas must all be GPUs or all be CPU: {devices}")
    return devices


def parse_devices_arg(text: str) -> list[torch.device] | None:
    """A command-line device list: ``auto`` (None), ``cpu``, ``cuda``, ``0,1``, ``cuda:0,cuda:1``, ``cpu,cpu``.

    ``cuda`` alone means every visible GPU.
    """
    text = text.strip()
    if text == "auto":
        return None
    if text == "cuda":
        gpus = visible_gpus()
        if not gpus:
            _require_cuda("--devices", "cuda")
        return gpus
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise DeviceError(
            f"--devices {text!r} has an empty entry; write a comma-separated list such as cpu,cpu or cuda:0,cuda:1"
        )
    return parse_device_list(parts, what="--devices")
