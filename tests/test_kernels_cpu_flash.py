"""selective_attention on the CPU flash backends ("bf16_flash": the compiled AVX512-BF16 loop;
"cpu_flash": torch's CPU flash kernel in blocks) against the reference."""

import pytest
import torch
import torch.nn.functional as F

from ragkv.kernels import bf16_flash, cpu_extension, cpu_flash, reference, selective_attention
from ragkv.kernels.dispatch import BackendUnavailableError
from ragkv.kernels.selective_attention import reads_cache_in_place, takes_whole_prefills

BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(params=["bf16_flash", "compiled", "loop"])
def flash_backend(request, monkeypatch) -> str:
    """The backend under test: the compiled bf16 loop (where the compiler targets AVX512-BF16),
    or torch's flash kernel in blocks run by the compiled extension (where it builds) or by
    the Python loop."""
    if request.param == "loop":
        monkeypatch.setattr(cpu_extension, "load", lambda: None)
        return "cpu_flash"
    if cpu_extension.load() is None:
        pytest.skip("the compiled CPU kernels are not built here")
    if request.param == "bf16_flash" and not bf16_flash.built(cpu_extension.load()):
        pytest.skip("the compiled bf16 loop needs a compiler targeting AVX512-BF16")
    return "bf16_flash" if request.param == "bf16_flash" else "cpu_flash"


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
def test_matches_reference_on_unsorted_rows(hkv, group, n, t, flash_backend):
    """Any row order, duplicates, position 0 and the last row."""
    q, k, v, g = make_inputs(hkv, group, n, t, 64, seed=n + t + group, spare=5)
    positions = torch.randint(0, t, (n,), generator=g)
    positions[0] = t - 1
    if n > 2:
        positions[1], positions[2] = 0, positions[-1]
    out = selective_attention(q, k, v, positions, 0.125, backend=flash_backend)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected(q, k, v, positions, 0.125), **BF16)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_sorted_blocks_with_and_without_a_prefix_part(d, flash_backend):
    """Sorted rows as the engine passes them: the first block starts at position 0 (no
    unmasked part), later blocks merge an unmasked prefix with their masked span; one block
    holds a single position many times."""
    q, k, v, g = make_inputs(2, 3, 3 * cpu_flash.BLOCK_ROWS + 5, 900, d, seed=d)
    positions = torch.randint(0, 900, (q.shape[1],), generator=g).sort().values
    positions[:3] = 0
    positions[cpu_flash.BLOCK_ROWS : 2 * cpu_flash.BLOCK_ROWS] = 450
    scale = d**-0.5
    out = selective_attention(q, k, v, positions, scale, backend=flash_backend)
    torch.testing.assert_close(out.float(), expected(q, k, v, positions, scale), **BF16)


def test_position_zero_sees_only_first_row(flash_backend):
    q, k, v, _ = make_inputs(1, 2, 2, 40, 64, seed=12)
    out = selective_attention(q, k, v, torch.tensor([0, 39]), 0.125, backend=flash_backend)
    torch.testing.assert_close(out[:, 0], v[0, 0].expand(2, 64))


def test_all_rows_equals_causal_sdpa(flash_backend):
    t = 150
    q, k, v, _ = make_inputs(3, 3, t, t, 64, seed=4)
    out = selective_attention(q, k, v, torch.arange(t), 0.2, backend=flash_backend)
    full = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(out.float(), full, **BF16)


def test_rows_past_the_last_position_are_never_read(flash_backend):
    """A cache buffer's rows past the rows' last position hold anything (torch.empty): NaN there
    must not reach the output, whatever block the last position ends."""
    for t in (63, 64, 65, 130):
        q, k, v, g = make_inputs(3, 3, 20, t, 64, seed=t, spare=70)
        base_k, base_v = k.clone(), v.clone()
        positions = torch.randint(0, t, (20,), generator=g).sort().values
        positions[-1] = t - 1
        k.as_strided((3, 70, 64), (k.stride(0), k.stride(1), 1), t * k.stride(1)).fill_(float("nan"))
        v.as_strided((3, 70, 64), (v.stride(0), v.stride(1), 1), t * v.stride(1)).fill_(float("nan"))
        out = selective_attention(q, k, v, positions, 0.125, backend=flash_backend)
        torch.testing.assert_close(out.float(), expected(q, base_k, base_v, positions, 0.125), **BF16)


def test_a_whole_prefill_goes_through_the_bf16_loop_where_auto_picks_it(monkeypatch):
    """The engine's causal attention from row 0 takes the compiled bf16 loop where "auto"
    picks it (torch's SDPA elsewhere), and both match the float32 causal attention."""
    from ragkv.engine.attention import causal_attention

    t = 200
    q, k, v, _ = make_inputs(3, 3, t, t, 64, seed=8)
    calls = []
    real = selective_attention
    monkeypatch.setattr(
        "ragkv.engine.attention.selective_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    out = causal_attention(q, k, v, torch.arange(t), 0.125)
    full = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out.float(), full, **BF16)
    assert bool(calls) == takes_whole_prefills(q, k, v)


def test_offered_for_bfloat16_caches_only():
    q, k, v, _ = make_inputs(1, 2, 3, 10, 64, seed=0)
    with pytest.raises(BackendUnavailableError, match="no cpu_flash backend"):
        selective_attention(q.float(), k.float(), v.float(), torch.tensor([1, 2, 3]), 0.1, backend="cpu_flash")


@pytest.mark.parametrize("flash", [False, True])
def test_auto_picks_torch_flash_only_on_cpus_with_avx512_bf16(monkeypatch, flash):
    monkeypatch.setattr(cpu_flash, "fast_here", lambda: flash)
    monkeypatch.setattr(bf16_flash, "built", lambda module: False)
    q, k, v, _ = make_inputs(3, 3, 20, 90, 64, seed=5, spare=30)
    positions = torch.arange(40, 60)
    calls = []
    monkeypatch.setattr(cpu_flash, "selective_attention", lambda *args: calls.append(args) or args[0])
    selective_attention(q, k, v, positions, 0.125)
    assert len(calls) == int(flash)
    if flash:
        assert reads_cache_in_place(q, k, v)
    assert not takes_whole_prefills(q, k, v)


@pytest.mark.parametrize(
    "flags,picked",
    [({"avx512_bf16"}, "bf16_flash"), ({"avx512_bf16", "amx_bf16"}, "cpu_flash")],
)
def test_auto_picks_the_bf16_loop_where_built_and_there_is_no_amx(monkeypatch, flags, picked):
    """Built for AVX512-BF16: "auto" runs the loop, selective rows and whole prefills alike,
    unless the CPU has AMX, where torch's flash kernel stays (it runs on the tile units)."""
    monkeypatch.setattr(bf16_flash, "built", lambda module: True)
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: frozenset({"avx2", "fma", *flags}))
    q, k, v, _ = make_inputs(3, 3, 20, 90, 64, seed=6)
    calls = []
    for module in (bf16_flash, cpu_flash):
        name = module.__name__.rsplit(".", 1)[1]
        monkeypatch.setattr(module, "selective_attention", lambda *args, name=name: calls.append(name) or q)
    selective_attention(q, k, v, torch.arange(70, 90), 0.125)
    assert calls == [picked]
    assert takes_whole_prefills(q, k, v) == (picked == "bf16_flash")
    assert reads_cache_in_place(q, k, v)


def test_the_bf16_loop_takes_head_dims_of_64_only():
    """A head dim that is no multiple of 64 is not offered to it (forced, a clear error)."""
    q, k, v, _ = make_inputs(1, 2, 3, 10, 80, seed=1)
    with pytest.raises(BackendUnavailableError, match="no bf16_flash backend"):
        selective_attention(q, k, v, torch.tensor([1, 2, 3]), 0.1, backend="bf16_flash")
