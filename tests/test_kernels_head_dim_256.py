"""Every attention-side kernel at head_dim 256 (Gemma 3: 4 query heads over 1 KV head of 256)
against the torch reference: compiled CPU, Triton (interpreter, conftest) and torch paths.

The existing kernel tests stop at 128; 256 is the compiled kernels' kMaxDim and doubles
the Triton tiles, so each backend is checked at that width here.
"""

from __future__ import annotations

import math

import pytest
import torch

from ragkv.kernels import (
    apply_rope,
    cpu_extension,
    decode_attention,
    reference,
    selective_attention,
    sparse_decode_attention,
)
from ragkv.kernels.kv_quant import quantize
from ragkv.kernels.place_kv import place_keys, place_values

DIM, HEADS, KV_HEADS = 256, 4, 1
SCALE = 1.0 / math.sqrt(DIM)
needs_cpp = pytest.mark.skipif(not cpu_extension.buildable(), reason="no C++ compiler or ninja on this machine")


def _cache(kv_heads: int, rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(2, kv_heads, rows, DIM, generator=generator) * 2
    return buffer[0].to(dtype), buffer[1].to(dtype)


def _decode_batch(lengths, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), HEADS, DIM, generator=generator)
    keys, values = [], []
    for b, length in enumerate(lengths):
        k, v = _cache(KV_HEADS, length + 5, dtype, seed + b + 1)
        k[:, length:] = 1e4  # rows past the length must not be read
        v[:, length:] = 1e4
        keys.append(k)
        values.append(v)
    return q, keys, values


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_attention(dtype):
    assert cpu_extension.supports_heads(HEADS, KV_HEADS, DIM)
    lengths = [1, 255, 257, 600]
    q, keys, values = _decode_batch(lengths, dtype)
    got = decode_attention(q, keys, values, lengths, SCALE, backend="cpp")
    torch.testing.assert_close(got, reference.decode_attention(q, keys, values, lengths, SCALE), atol=2e-5, rtol=2e-5)


@needs_cpp
def test_compiled_decode_attention_over_a_window_view():
    """A sliding-window layer decodes over a view that starts inside the cache buffer."""
    q, keys, values = _decode_batch([700], torch.bfloat16, seed=4)
    start, length = 700 - 512, 512
    got = decode_attention(q, [keys[0][:, start:]], [values[0][:, start:]], [length], SCALE, backend="cpp")
    expected = reference.decode_attention(q, [keys[0][:, start:700]], [values[0][:, start:700]], [length], SCALE)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention(dtype):
    lengths = [3, 130]
    q, keys, values = _decode_batch(lengths, dtype, seed=2)
    got = decode_attention(q, keys, values, lengths, SCALE, backend="triton")
    expected = reference.decode_attention(q, keys, values, lengths, SCALE)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, expected, **tolerance)


def test_torch_decode_attention():
    lengths = [9, 300]
    q, keys, values = _decode_batch(lengths, torch.float32, seed=3)
    got = decode_attention(q, keys, values, lengths, SCALE, backend="torch")
    torch.testing.assert_close(got, reference.decode_attention(q, keys, values, lengths, SCALE), atol=1e-5, rtol=1e-5)


def _selective_inputs(n: int, t: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, n, DIM, generator=generator).to(dtype)
    k, v = _cache(KV_HEADS, t, dtype, seed + 1)
    positions = torch.randint(0, t, (n,), generator=generator)
    positions[0] = t - 1
    return q, k, v, positions


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,t", [(1, 9), (45, 300)])
def test_compiled_selective_attention(dtype, n, t):
    q, k, v, positions = _selective_inputs(n, t, dtype, seed=n + t)
    got = selective_attention(q, k, v, positions, SCALE, backend="cpp")
    expected = reference.selective_attention(q.float(), k.float(), v.float(), positions, SCALE)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_selective_attention(backend):
    q, k, v, positions = _selective_inputs(20, 83, torch.float32, seed=7)
    got = selective_attention(q, k, v, positions, SCALE, backend=backend)
    torch.testing.assert_close(got, reference.selective_attention(q, k, v, positions, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_decode_attention(backend, dtype):
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(HEADS, DIM, generator=generator).to(dtype)
    k, v = _cache(KV_HEADS, 150, dtype, 12)
    indices = torch.randint(0, 150, (KV_HEADS, 37), generator=generator)
    out, lse = sparse_decode_attention(q, k, v, indices, SCALE, return_lse=True, backend=backend)
    expected, expected_lse = reference.sparse_decode_attention(q, k, v, indices, SCALE, None)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope(backend):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(KV_HEADS, 40, DIM, generator=generator)
    angles = torch.rand(40, DIM // 2, generator=generator) * 2 * math.pi
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    expected = reference.rope(x, cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin, backend=backend), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_place_quantized_chunk(bits):
    """Chunk placement dequantises and rotates the two 128-wide halves of each 256 row."""
    generator = torch.Generator().manual_seed(bits)
    keys = torch.randn(3, KV_HEADS, 70, DIM, generator=generator)
    values = torch.randn(3, KV_HEADS, 70, DIM, generator=generator)
    stored_keys, stored_values = quantize(keys, bits, "tokens", 32), quantize(values, bits, "channels", 32)
    angles = (torch.arange(100, 170)[:, None] * torch.rand(DIM // 2, generator=generator)).float()
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    out_keys, out_values = torch.empty(3, KV_HEADS, 70, DIM), torch.empty(3, KV_HEADS, 70, DIM)
    place_keys(out_keys, stored_keys, cos, sin)
    place_values(out_values, stored_values)
    expected = reference.place_keys(stored_keys, cos, sin, torch.float32)
    torch.testing.assert_close(out_keys, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_values, reference.place_values(stored_values, torch.float32))
