"""Integer chunk K/V: quantisation error bounds against the float tensor, and the fused
placement (dequantise + RoPE into a cache slice) against dequantise-then-place."""

from __future__ import annotations

import pytest
import torch

from ragkv.engine.kv_storage import KV_STORAGE_FORMATS, KVStorageFormat, dense
from ragkv.kernels import reference
from ragkv.kernels.kv_quant import QuantizedKV, quantize
from ragkv.kernels.place_kv import place_keys, place_values

SHAPE = (3, 2, 300, 64)  # 300 tokens: the last key group is shorter than the others


def kv_like(seed: int, outlier_channels: bool = True) -> torch.Tensor:
    """Gaussian K/V; keys get a few large channels, the structure per-channel key scales
    are for (values have none, so they are grouped per token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    if outlier_channels:
        x[..., 5] *= 12.0
        x[..., 40] += 6.0
    return x


def rope_tables(tokens: int, dim: int, start: int = 700) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(start, start + tokens, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "grouping,group", [("tokens", 128), ("tokens", 32), ("channels", 64), ("channels", 16), ("channels", 128)]
)
def test_every_element_within_half_a_step(bits, grouping, group):
    x = kv_like(bits + group)
    quantized = quantize(x, bits, grouping, group)
    assert quantized.shape == SHAPE
    error = (reference.dequantize(quantized) - x).abs()
    if grouping == "tokens":
        step = quantized.scale.float()[:, :, torch.arange(SHAPE[2]) // group]
    elif group == SHAPE[1] * SHAPE[3]:
        step = quantized.scale.float().expand(SHAPE)
    else:
        step = quantized.scale.float().repeat_interleave(group, dim=3)
    # Half a quantisation step, plus the float16 rounding of the group minimum.
    assert bool((error <= step * 0.5 + x.abs() * 1e-3 + 1e-6).all())


@pytest.mark.parametrize("name,relative_bound", [("int8", 0.01), ("int4", 0.12), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_storage_format_round_trip_error(name, relative_bound):
    fmt = KV_STORAGE_FORMATS[name]
    keys, values = kv_like(1), kv_like(2, outlier_channels=False)
    stored_keys, stored_values = fmt.unpack(fmt.pack(keys, values))
    for original, stored in ((keys, stored_keys), (values, stored_values)):
        restored = dense(stored, torch.float32)
        relative = float((restored - original).norm() / original.norm())
        assert relative < relative_bound
    assert fmt.quantized == (name.startswith("int"))


def test_descriptors_name_the_groups():
    assert KV_STORAGE_FORMATS["int4"].descriptor == "int4:k256:vlayer"
    assert KV_STORAGE_FORMATS["int8"].descriptor == "int8:k128:v64"
    assert KV_STORAGE_FORMATS["float16"].descriptor == "float16"  # unchanged: old float16 stores stay valid


def test_four_bit_codes_are_half_the_bytes_of_eight():
    x = kv_like(3)
    eight, four = quantize(x, 8, "channels", 64), quantize(x, 4, "channels", 64)
    assert four.codes.numel() * 2 == eight.codes.numel() == x.numel()
    torch.testing.assert_close(reference.dequantize(four), x, atol=float(four.scale.max()), rtol=0)


def test_constant_group_round_trips_exactly():
    x = torch.full(SHAPE, 0.75)
    torch.testing.assert_close(reference.dequantize(quantize(x, 4, "tokens", 128)), x)


PLACEMENT_FORMATS = {
    **{name: KV_STORAGE_FORMATS[name] for name in ("int8", "int4", "float16")},
    "int4 per-head values": KVStorageFormat("int4", bits=4, key_group=32, value_group=64),
    "int8 half-head values": KVStorageFormat("int8", bits=8, key_group=300, value_group=32),
}


@pytest.mark.parametrize("name", list(PLACEMENT_FORMATS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fused_placement_equals_dequantise_then_place(name, out_dtype):
    fmt = PLACEMENT_FORMATS[name]
    stored_keys, stored_values = fmt.unpack(fmt.pack(kv_like(4), kv_like(5)))
    layers, heads, tokens, dim = SHAPE
    cos, sin = rope_tables(tokens, dim)
    cache = torch.full((2, layers, heads, tokens + 20, dim), float("nan"), dtype=out_dtype)
    place_keys(cache[0, :, :, 10 : 10 + tokens], stored_keys, cos, sin)
    place_values(cache[1, :, :, 10 : 10 + tokens], stored_values)
    tolerance = dict(atol=1e-5, rtol=1e-5) if out_dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(
        cache[0, :, :, 10 : 10 + tokens], reference.place_keys(stored_keys, cos, sin, out_dtype), **tolerance
    )
    torch.testing.assert_close(
        cache[1, :, :, 10 : 10 + tokens], reference.place_values(stored_values, out_dtype), **tolerance
    )
    assert bool(cache[:, :, :, :10].isnan().all()) and bool(cache[:, :, :, 10 + tokens :].isnan().all())


def test_placement_refuses_mismatched_rows():
    stored = quantize(kv_like(6), 4, "tokens", 128)
    with pytest.raises(ValueError, match="does not match"):
        place_values(torch.empty(3, 2, 299, 64), stored)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedKV(stored.codes.float(), stored.scale, stored.minimum, 4, "tokens", 128)


def test_unpack_refuses_a_blob_of_another_format():
    int4, float16 = KV_STORAGE_FORMATS["int4"], KV_STORAGE_FORMATS["float16"]
    packed = int4.pack(kv_like(7), kv_like(8))
    with pytest.raises(ValueError, match="float16"):
        float16.unpack(packed)
    with pytest.raises(ValueError, match="int4"):
        int4.unpack(float16.pack(kv_like(7), kv_like(8)))
