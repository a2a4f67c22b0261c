"""Rotate-half RoPE applied to a whole head-major tensor.

Used for position recovery: chunk keys are cached pre-RoPE, concatenated in
prompt order, then rotated here with the global positions they finally occupy.
"""

from __future__ import annotations

import torch

from ragkv.kernels import reference
from ragkv.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, common_device, require
from ragkv.kernels.dispatch import Backend, select_backend

_BLOCK_T = 32


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """Return ``x * cos + rotate_half(x) * sin`` (Hugging Face Llama convention).

    Args:
        x: [heads, T, D], D even; float32/float16/bfloat16.
        cos, sin: [T, D], already gathered for each token's position (and
            carrying any attention scaling the caller folds in); any float dtype.
        backend: "auto", "torch" or "triton".

    Returns a new tensor shaped and typed like ``x``, computed in float32.
    """
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("cos", cos, FLOAT_DTYPES)
    check_dtype("sin", sin, FLOAT_DTYPES)
    require(x.dim() == 3, f"x must be [heads, T, D], got {tuple(x.shape)}")
    heads, t, d = x.shape
    require(d % 2 == 0, f"head dim must be even for rotate-half RoPE, got {d}")
    check_shape("cos", cos, (t, d))
    check_shape("sin", sin, (t, d))
    device = common_device(x=x, cos=cos, sin=sin)

    chosen = select_backend("apply_rope", backend, device, kernels=("triton",))
    if chosen == "torch":
        return reference.rope(x, cos, sin)

    import triton

    from ragkv.kernels.triton.rope import rope_kernel

    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    if out.numel() == 0:
        return out
    grid = (heads, triton.cdiv(t, _BLOCK_T))
    rope_kernel[grid](
        x,
        cos,
        sin,
        out,
        t,
        d // 2,
        *x.stride(),
        *cos.stride(),
        *sin.stride(),
        *out.stride(),
        BLOCK_T=_BLOCK_T,
        BLOCK_HALF=triton.next_power_of_2(d // 2),
    )
    return out
