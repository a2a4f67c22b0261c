"""Argument checks shared by the op launchers.

Launchers validate shapes, dtypes and devices (cheap, host-side) but not index
*values* (codes in range, positions < T): checking those would force a device
sync on every call, so they are documented preconditions instead.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless ``condition`` holds."""
    if not condition:
        raise ValueError(message)


def common_device(**tensors: torch.Tensor | None) -> torch.device:
    """The device shared by all non-None ``tensors``; ValueError if they differ."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")
    return next(iter(devices.values()))


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """ValueError unless ``tensor.dtype`` is one of ``allowed``."""
    require(tensor.dtype in allowed, f"{name} must have dtype in {allowed}, got {tensor.dtype}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """ValueError unless ``tensor`` matches ``shape`` (None matches any size)."""
    ok = tensor.dim() == len(shape) and all(want is None or want == got for want, got in zip(shape, tensor.shape))
    shown = tuple("*" if s is None else s for s in shape)
    require(ok, f"{name} must have shape {shown}, got {tuple(tensor.shape)}")
