"""apply_rope: Triton vs torch reference, and the reference vs complex rotation."""

import pytest
import torch

from ragkv.kernels import apply_rope, reference

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # The interpreter rounds float32 -> bfloat16 toward zero, torch to nearest: 1 ulp apart.
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}


def hf_cos_sin(positions: torch.Tensor, d: int, base: float = 10000.0):
    """cos/sin tables as Hugging Face Llama builds them, plus the raw angles [T, D/2]."""
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().float(), emb.sin().float(), angles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 45])  # 45: not a multiple of the 32-token block
@pytest.mark.parametrize("heads", [1, 3])
def test_triton_matches_reference(heads, t, d, dtype):
    g = torch.Generator().manual_seed(heads * 1000 + t + d)
    x = torch.randn(heads, t, d, generator=g).to(dtype)
    cos, sin, _ = hf_cos_sin(torch.randint(0, 4096, (t,), generator=g), d)
    out = apply_rope(x, cos, sin, backend="triton")
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.rope(x, cos, sin), **TOL[dtype])


def test_triton_unpaired_tables_and_strided_input():
    """Arbitrary (scaled, half-asymmetric) cos/sin and a non-contiguous x."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 4, 64, generator=g).transpose(0, 1)  # [H, T, D] view with token-major storage
    cos = torch.randn(37, 64, generator=g) * 1.3
    sin = torch.randn(37, 64, generator=g) * 0.7
    torch.testing.assert_close(
        apply_rope(x, cos, sin, backend="triton"), reference.rope(x, cos, sin), **TOL[torch.float32]
    )


def test_reference_is_complex_rotation():
    """Rotate-half RoPE rotates each pair (x_i, x_{i+D/2}) by its angle, as a complex product."""
    g = torch.Generator().manual_seed(1)
    heads, t, d = 2, 9, 64
    x = torch.randn(heads, t, d, generator=g, dtype=torch.float64)
    cos, sin, angles = hf_cos_sin(torch.arange(100, 100 + t), d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(reference.rope(x.float(), cos, sin).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_position_recovery_composes(backend):
    """Rotating a key cached at position p by a further delta equals rotating it to p + delta."""
    g = torch.Generator().manual_seed(2)
    d = 64
    x = torch.randn(2, 5, d, generator=g)
    start = torch.arange(3, 8)
    cos_a, sin_a, _ = hf_cos_sin(start, d)
    cos_b, sin_b, _ = hf_cos_sin(torch.full((5,), 500), d)
    cos_ab, sin_ab, _ = hf_cos_sin(start + 500, d)
    twice = apply_rope(apply_rope(x, cos_a, sin_a, backend=backend), cos_b, sin_b, backend=backend)
    torch.testing.assert_close(twice, apply_rope(x, cos_ab, sin_ab, backend=backend), atol=1e-4, rtol=1e-4)


def test_rejects_bad_arguments():
    x = torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(2, 4, 5), torch.randn(4, 5), torch.randn(4, 5))
    with pytest.raises(ValueError, match="cos"):
        apply_rope(x, torch.randn(3, 6), torch.randn(4, 6))
    with pytest.raises(ValueError, match="dtype"):
        apply_rope(x.int(), torch.randn(4, 6), torch.randn(4, 6))
