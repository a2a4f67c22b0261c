"""int4 decode weights: the packed rows hold a Q4_1 checkpoint exactly, the compiled kernel
equals its torch reference (activations quantized to int8 per group of 32, exact
arithmetic), and the fallback without the compiled kernels stays close."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import SKIP_REASON, run_compiled_tests  # tests/ is on sys.path

from ragkv.engine.linear import INT4_GROUP_SIZE, Int4Kernel, pack_int4_rows, unpack_int4_rows
from ragkv.engine.numerics import Numerics
from ragkv.kernels import cpu_extension

needs_compiled = pytest.mark.skipif(not run_compiled_tests(), reason=SKIP_REASON)


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as a Q4_1 GGUF block stores it: codes 0..15 (both ends used in every block,
    as llama.cpp's min/max quantizer does), float16 scale and minimum, w = q * d + m."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // INT4_GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, groups, INT4_GROUP_SIZE), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3).half()
    low = (-torch.rand(out_features, groups, generator=generator) * 0.1).half()
    return (codes.float() * scale.float()[..., None] + low.float()[..., None]).flatten(1)


def reference(x: torch.Tensor, kernel: Int4Kernel) -> torch.Tensor:
    """The compiled kernel's arithmetic in float64: each group of 32 activations scaled to
    int8 by its largest magnitude (round half to even), times the dequantized weights."""
    codes, scale, low = unpack_int4_rows(kernel.rows, kernel.in_features)
    groups = x.float().view(x.shape[0], -1, INT4_GROUP_SIZE)
    peak = groups.abs().amax(-1, keepdim=True)
    quantized = torch.round(groups * torch.where(peak > 0, 127 / peak, torch.zeros_like(peak)))
    activations = quantized.double() * (peak / 127).double()
    weight = codes.double() * scale.double()[..., None] + low.double()[..., None]
    return torch.einsum("rgi,ogi->ro", activations, weight)


def test_rows_hold_q4_1_blocks_exactly():
    weight = q4_1_weight(40, 96)
    assert torch.equal(Int4Kernel(weight).dequantized(), weight)


@pytest.mark.parametrize("in_features", [32, 96, 576])
def test_pack_and_unpack_are_inverse(in_features):
    groups = in_features // INT4_GROUP_SIZE
    codes = torch.randint(0, 16, (5, groups, INT4_GROUP_SIZE), dtype=torch.uint8)
    scale, low = torch.rand(5, groups).half(), torch.randn(5, groups).half()
    rows = pack_int4_rows(codes, scale, low)
    assert rows.shape == (5, 32 * ((groups + 1) // 2) + 4 * (-(-groups // 8) * 8))
    for got, want in zip(unpack_int4_rows(rows, in_features), (codes, scale, low)):
        assert torch.equal(got, want)


@needs_compiled
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(7, 32), (40, 96), (130, 576)])
def test_compiled_kernel_equals_its_reference(rows, shape):
    kernel = Int4Kernel(q4_1_weight(*shape))
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :INT4_GROUP_SIZE] = 0  # an all-zero group: scale 0, codes 0
    got = kernel(x)
    want = reference(x, kernel)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@needs_compiled
def test_compiled_kernel_is_close_to_the_float_product():
    kernel = Int4Kernel(q4_1_weight(64, 576))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ kernel.dequantized().double().t()
    # int8 activations per group: error ~ 1/254 of each group's largest activation
    assert ((kernel(x).double() - exact).abs().max() / exact.abs().max()) < 0.01


def test_without_compiled_kernels_torch_int4_runs_the_same_weights(monkeypatch):
    kernel = Int4Kernel(q4_1_weight(64, 96))
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(cpu_extension, "load", lambda: None)
    got = kernel(x)
    exact = x @ kernel.dequantized().t()
    # bf16 activations, scale and zero
    assert ((got - exact).abs().max() / exact.abs().max()) < 0.03


def test_the_lm_head_of_int4_layers_is_int8():
    assert Numerics("float32", "float32", "int4", "float32").lm_head_weights == "int8"
    assert Numerics("float32", "float32", "int8", "float32").lm_head_weights == "int8"
    assert Numerics.uniform(torch.float32).lm_head_weights == "float32"
