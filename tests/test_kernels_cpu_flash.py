"""selective_attention on torch's CPU flash kernel (backend "cpu_flash") against the reference."""

import pytest
import torch
import torch.nn.functional as F

from ragkv.kernels import cpu_extension, cpu_flash, reference, selective_attention
from ragkv.kernels.dispatch import BackendUnavailableError
from ragkv.kernels.selective_attention import reads_cache_in_place

BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(params=["compiled", "loop"])
def blocks_path(request, monkeypatch):
    """The blocks run by the compiled extension (where it builds) or by the Python loop."""
    if request.param == "loop":
        monkeypatch.setattr(cpu_extension, "load", lambda: None)
    elif cpu_extension.load() is None:
        pytest.skip("the compiled CPU kernels are not built here")
    return request.param


def make_inputs(hkv, group, n, t, d, seed, spare=0):
    """bfloat16 q [Hq, N, D] and cache rows [Hkv, T, D] viewed from buffers of T + spare rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * group, n, d, generator=g).bfloat16()
    k = torch.randn(hkv, t + spare, d, generator=g).bfloat16()[:, :t]
    v = torch.randn(hkv, t + spare, d, generator=g).bfloat16()[:, :t]
    return q, k, v, g


def expected(q, k, v, positions, scale):
    return reference.selective_attention(q.float(), k.float(), v.float(), positions, scale)


@pytest.mark.parametrize("n,t", [(1, 9), (7, 40), (70, 300), (300, 700)])  # 1 to 5 row blocks, one partial
@pytest.mark.parametrize("hkv,group", [(3, 3), (2, 1), (1, 8)])
def test_matches_reference_on_unsorted_rows(hkv, group, n, t, blocks_path):
    """Any row order, duplicates, position 0 and the last row."""
    q, k, v, g = make_inputs(hkv, group, n, t, 64, seed=n + t + group, spare=5)
    positions = torch.randint(0, t, (n,), generator=g)
    positions[0] = t - 1
    if n > 2:
        positions[1], positions[2] = 0, positions[-1]
    out = selective_attention(q, k, v, positions, 0.125, backend="cpu_flash")
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected(q, k, v, positions, 0.125), **BF16)


@pytest.mark.parametrize("d", [64, 128])
def test_sorted_blocks_with_and_without_a_prefix_part(d, blocks_path):
    """Sorted rows as the engine passes them: the first block starts at position 0 (no
    unmasked part), later blocks merge an unmasked prefix with their masked span; one block
    holds a single position many times."""
    q, k, v, g = make_inputs(2, 3, 3 * cpu_flash.BLOCK_ROWS + 5, 900, d, seed=d)
    positions = torch.randint(0, 900, (q.shape[1],), generator=g).sort().values
    positions[:3] = 0
    positions[cpu_flash.BLOCK_ROWS : 2 * cpu_flash.BLOCK_ROWS] = 450
    scale = d**-0.5
    out = selective_attention(q, k, v, positions, scale, backend="cpu_flash")
    torch.testing.assert_close(out.float(), expected(q, k, v, positions, scale), **BF16)


def test_position_zero_sees_only_first_row(blocks_path):
    q, k, v, _ = make_inputs(1, 2, 2, 40, 64, seed=12)
    out = selective_attention(q, k, v, torch.tensor([0, 39]), 0.125, backend="cpu_flash")
    torch.testing.assert_close(out[:, 0], v[0, 0].expand(2, 64))


def test_all_rows_equals_causal_sdpa(blocks_path):
    t = 150
    q, k, v, _ = make_inputs(3, 3, t, t, 64, seed=4)
    out = selective_attention(q, k, v, torch.arange(t), 0.2, backend="cpu_flash")
    full = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out.float(), full, **BF16)


def test_offered_for_bfloat16_caches_only():
    q, k, v, _ = make_inputs(1, 2, 3, 10, 64, seed=0)
    with pytest.raises(BackendUnavailableError, match="no cpu_flash backend"):
        selective_attention(q.float(), k.float(), v.float(), torch.tensor([1, 2, 3]), 0.1, backend="cpu_flash")


@pytest.mark.parametrize("flash", [False, True])
def test_auto_picks_it_only_on_cpus_with_avx512_bf16(monkeypatch, flash):
    monkeypatch.setattr(cpu_flash, "fast_here", lambda: flash)
    q, k, v, _ = make_inputs(3, 3, 20, 90, 64, seed=5, spare=30)
    positions = torch.arange(40, 60)
    calls = []
    monkeypatch.setattr(cpu_flash, "selective_attention", lambda *args: calls.append(args) or args[0])
    selective_attention(q, k, v, positions, 0.125)
    assert len(calls) == int(flash)
    if flash:
        assert reads_cache_in_place(q, k, v)
