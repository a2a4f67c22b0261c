"""Batched decode attention and the few-row int8 matmul: the compiled CPU kernels and the
torch paths against the torch references (kernels/reference.py, plain float32 matmuls)."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import SKIP_REASON, run_compiled_tests  # tests/ is on sys.path

from ragkv.kernels import cpu_extension, reference
from ragkv.kernels.decode_attention import decode_attention
from ragkv.kernels.dispatch import BackendUnavailableError

compiled = pytest.mark.skipif(not run_compiled_tests(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def extension():
    module = cpu_extension.load()
    assert module is not None, "a compiler is present, so the compiled kernels must build"
    return module


def _batch(lengths, heads, kv_heads, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), heads, dim, generator=generator)
    keys, values = [], []
    for length in lengths:
        # spare capacity past the valid rows, filled with huge values a kernel must not read
        buffer = torch.randn(2, kv_heads, length + 7, dim, generator=generator) * 3
        buffer[:, :, length:] = 1e4
        keys.append(buffer[0].to(dtype))
        values.append(buffer[1].to(dtype))
    return q, keys, values


CASES = [
    # lengths (block edges at 256), heads, kv heads, head dim
    ([1, 37, 256, 257, 700], 9, 3, 64),
    ([5, 513], 8, 1, 128),
    ([300], 4, 4, 16),
    ([64, 1, 999], 32, 2, 64),
]


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,heads,kv_heads,dim", CASES)
def test_compiled_matches_reference(extension, dtype, lengths, heads, kv_heads, dim):
    q, keys, values = _batch(lengths, heads, kv_heads, dim, dtype)
    expected = reference.decode_attention(q, keys, values, lengths, 0.125)
    got = decode_attention(q, keys, values, lengths, 0.125, backend="cpp")
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,heads,kv_heads,dim", CASES[:2] + CASES[3:])
def test_triton_matches_reference(dtype, lengths, heads, kv_heads, dim):
    """The split-K kernel under TRITON_INTERPRET (conftest): rows past each length hold 1e4,
    so reading one would show; lengths cross split and block edges."""
    q, keys, values = _batch(lengths, heads, kv_heads, dim, dtype, seed=3)
    expected = reference.decode_attention(q, keys, values, lengths, 0.125)
    got = decode_attention(q, keys, values, lengths, 0.125, backend="triton")
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_path_matches_reference(dtype):
    lengths = [3, 130, 41]
    q, keys, values = _batch(lengths, 9, 3, 64, dtype, seed=1)
    q = q.to(dtype)
    expected = reference.decode_attention(q, keys, values, lengths, 0.125)
    got = decode_attention(q, keys, values, lengths, 0.125, backend="torch")
    tolerance = 1e-5 if dtype == torch.float32 else 0.1  # 16-bit weights and products: values are ~3
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@compiled
def test_one_request_of_a_batch_equals_it_alone(extension):
    lengths = [10, 400, 77]
    q, keys, values = _batch(lengths, 9, 3, 64, torch.bfloat16, seed=2)
    together = decode_attention(q, keys, values, lengths, 0.125, backend="cpp")
    for b, length in enumerate(lengths):
        alone = decode_attention(q[b : b + 1], keys[b : b + 1], values[b : b + 1], [length], 0.125, backend="cpp")
        torch.testing.assert_close(together[b], alone[0], atol=0, rtol=0)


def test_float16_cache_has_no_compiled_path():
    q, keys, values = _batch([4], 2, 1, 16, torch.float16)
    with pytest.raises(BackendUnavailableError):
        decode_attention(q, keys, values, [4], 0.25, backend="cpp")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v, n: (q, k, v, [0]), "lengths"),
        (lambda q, k, v, n: (q, k, v, [k[0].shape[1] + 1]), "lengths"),
        (lambda q, k, v, n: (q, k, [v[0].to(torch.float64)], n), "laid out|dtype"),
        (lambda q, k, v, n: (q[:, :3], k, v, n), "multiple"),
        (lambda q, k, v, n: (q, k * 2, v, n), "one key"),
    ],
)
def test_bad_arguments_are_refused(change, message):
    q, keys, values = _batch([6], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(q, keys, values, [6]), 0.25)


@compiled
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (37, 64), (1000, 1536)])
def test_int8_linear_matches_dequantized_matmul(extension, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scales = (torch.rand(out_features, generator=generator) / 100).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=generator)
    expected = x.double() @ (weight.double() * scales.double()[:, None]).t()
    got = extension.int8_linear(x, weight, scales)
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * in_features**0.5, rtol=1e-4)
