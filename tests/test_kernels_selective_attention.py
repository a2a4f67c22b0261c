"""selective_attention: Triton vs torch reference, and agreement with causal SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F
from compiled_kernels import SKIP_REASON, run_compiled_tests  # tests/ is on sys.path

from ragkv.kernels import reference, selective_attention
from ragkv.kernels.dispatch import BackendUnavailableError
from ragkv.kernels.selective_attention import reads_cache_in_place

# bfloat16 is absent: the interpreter's tl.dot multiplies bfloat16 as raw uint16 bits
# (numpy has no bfloat16), so only a GPU can check that path.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


def make_inputs(hkv, group, n, t, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * group, n, d, generator=g).to(dtype)
    k = torch.randn(hkv, t, d, generator=g).to(dtype)
    v = torch.randn(hkv, t, d, generator=g).to(dtype)
    return q, k, v, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [1, 13, 70])  # 70 spans two 64-row query tiles
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 3)])
def test_triton_matches_reference(hkv, group, n, d, dtype):
    t = 83  # not a multiple of any block size
    q, k, v, g = make_inputs(hkv, group, n, t, d, dtype, seed=hkv * group * 100 + n + d)
    positions = torch.randint(0, t, (n,), generator=g)  # unsorted, may repeat
    scale = 1.0 / math.sqrt(d)
    out = selective_attention(q, k, v, positions, scale, backend="triton")
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.selective_attention(q, k, v, positions, scale), **TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 3)])
def test_all_rows_equals_causal_sdpa(hkv, group, backend):
    t, d = 50, 64
    q, k, v, _ = make_inputs(hkv, group, t, t, d, torch.float32, seed=4)
    out = selective_attention(q, k, v, torch.arange(t), 0.2, backend=backend)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0), is_causal=True, scale=0.2
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_subset_equals_rows_of_full_causal(backend):
    """Selective recompute: recomputing some rows gives exactly those rows of full causal attention."""
    hkv, group, t, d = 2, 3, 90, 64
    q, k, v, g = make_inputs(hkv, group, t, t, d, torch.float32, seed=6)
    rows = torch.randperm(t, generator=g)[:14]
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    out = selective_attention(q[:, rows], k, v, rows, 0.125, backend=backend)
    torch.testing.assert_close(out, full[:, rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", [31, 32, 64])
def test_triton_key_tile_boundaries(position):
    """A tile whose largest position starts a new 32-key tile must still read that key."""
    q, k, v, _ = make_inputs(2, 1, 1, 65, 64, torch.float32, seed=position)
    rows = torch.tensor([position])
    out = selective_attention(q, k, v, rows, 0.125, backend="triton")
    torch.testing.assert_close(out, reference.selective_attention(q, k, v, rows, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_position_zero_sees_only_first_row(backend):
    q, k, v, _ = make_inputs(1, 2, 2, 40, 64, torch.float32, seed=12)
    out = selective_attention(q, k, v, torch.tensor([0, 39]), 0.125, backend=backend)
    torch.testing.assert_close(out[:, 0], v[0, 0].expand(2, 64))
    assert not torch.allclose(out[:, 1], v[0, 0].expand(2, 64))


def test_rejects_bad_arguments():
    q, k, v, _ = make_inputs(2, 2, 3, 10, 64, torch.float32, seed=0)
    positions = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="row_positions"):
        selective_attention(q, k, v, positions[:2], 0.1)
    with pytest.raises(ValueError, match="row_positions"):
        selective_attention(q, k, v, positions.float(), 0.1)
    with pytest.raises(ValueError, match="multiple"):
        selective_attention(q[:3], k, v, positions, 0.1)
    with pytest.raises(ValueError, match="k_cache"):
        selective_attention(q, k[..., :32], v, positions, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_torch_path_matches_reference_on_many_unsorted_rows(dtype):
    """The CPU path groups rows by position (enough rows to trigger grouping, any order)."""
    hkv, group, t, d = 3, 3, 700, 64
    q, k, v, g = make_inputs(hkv, group, 300, t, d, dtype, seed=21)
    positions = torch.randperm(t, generator=g)[:300]
    out = selective_attention(q, k, v, positions, 0.125, backend="torch")
    torch.testing.assert_close(out, reference.selective_attention(q, k, v, positions, 0.125), **TOL[dtype])


needs_cpp = pytest.mark.skipif(not run_compiled_tests(), reason=SKIP_REASON)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,t", [(1, 9), (7, 40), (45, 300), (300, 700)])  # tiles of 1 to 10 rows, 1 to 22 key blocks
@pytest.mark.parametrize("hkv,group", [(3, 3), (2, 1), (1, 8)])
def test_cpp_matches_reference_on_unsorted_rows(hkv, group, n, t, dtype):
    """The compiled kernel: any row order, duplicates, position 0 and the last row."""
    q, k, v, g = make_inputs(hkv, group, n, t, 64, dtype, seed=n + t)
    positions = torch.randint(0, t, (n,), generator=g)
    positions[0] = t - 1
    if n > 2:
        positions[1], positions[2] = 0, positions[-1]
    out = selective_attention(q, k, v, positions, 0.125, backend="cpp")
    expected = reference.selective_attention(q.float(), k.float(), v.float(), positions, 0.125)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **tolerance)


@needs_cpp
def test_cpp_reads_a_cache_slice_in_place_and_auto_reads_it_in_place():
    q, k, v, _ = make_inputs(3, 3, 20, 90, 64, torch.bfloat16, seed=5)
    k_view, v_view = k[:, :60], v[:, :60]  # rows of a larger buffer, as the engine passes them
    positions = torch.arange(40, 60)
    assert reads_cache_in_place(q, k_view, v_view)  # the compiled kernel, or torch's flash kernel on AVX512-BF16
    out = selective_attention(q, k_view, v_view, positions, 0.125, backend="cpp")
    expected = reference.selective_attention(q.float(), k_view.float(), v_view.float(), positions, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_cpp_is_not_offered_for_head_dims_it_does_not_tile():
    q, k, v, _ = make_inputs(1, 2, 3, 10, 40, torch.float32, seed=0)
    assert not reads_cache_in_place(q, k, v)
    with pytest.raises(BackendUnavailableError, match="no cpp backend"):
        selective_attention(q, k, v, torch.tensor([1, 2, 3]), 0.1, backend="cpp")
