"""Blob encoding: bit-exact round trips, and every kind of damage is CorruptBlobError."""

from __future__ import annotations

import json
import random
import struct

import pytest
import safetensors.torch
import torch

from ragkv.store import CorruptBlobError, decode_blob, encode_blob
from ragkv.store.blob import mac_key_of


def small_blob() -> tuple[bytes, dict[str, torch.Tensor]]:
    tensors = {
        "keys": torch.arange(12, dtype=torch.float16).reshape(1, 2, 3, 2),
        "values": torch.arange(6, dtype=torch.bfloat16),
        "ids": torch.tensor([-3, 7], dtype=torch.int8),
    }
    return encode_blob(tensors, {"doc": "d1"}), tensors


def decode_fails(data: bytes | bytearray) -> bool:
    """True iff decoding raises CorruptBlobError; any other exception propagates and fails the test."""
    try:
        decode_blob(data)
    except CorruptBlobError:
        return True
    return False


def test_round_trip_with_metadata_and_empty_tensor() -> None:
    tensors = {
        "k": torch.randn(2, 3, 4).to(torch.float16),
        "v": torch.randn(2, 3, 4).to(torch.bfloat16),
        "f32": torch.tensor([float("nan"), -0.0, float("inf")]),
        "u8": torch.arange(256, dtype=torch.uint8),
        "i16": torch.tensor([-32768, 32767], dtype=torch.int16),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "empty": torch.zeros(0, 5),
    }
    decoded, metadata = decode_blob(encode_blob(tensors, {"model": "m", "n": "3"}))
    assert metadata == {"model": "m", "n": "3"}
    assert decoded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype and decoded[name].shape == tensor.shape
        assert torch.equal(decoded[name].view(torch.uint8), tensor.view(torch.uint8))


def test_blob_is_plain_safetensors() -> None:
    blob, tensors = small_blob()
    loaded = safetensors.torch.load(blob)
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


def test_accepts_views_noncontiguous_and_memoryview_input() -> None:
    kv = torch.randn(2, 4, 6)
    tensors = {"k": kv[0], "v": kv[1], "t": kv[:, :, 0]}  # shared storage, and a strided view
    blob = encode_blob(tensors)
    for data in (blob, bytearray(blob), memoryview(blob)):
        decoded, _ = decode_blob(data)
        assert all(torch.equal(decoded[name], tensors[name]) for name in tensors)


def test_decoded_tensors_are_writable_private_copies_of_read_only_input() -> None:
    blob, _ = small_blob()
    decoded, _ = decode_blob(blob)
    decoded["keys"].add_(1)  # must not touch the caller's immutable bytes
    assert decode_blob(blob).tensors["keys"][0, 0, 0, 0] == 0


def test_every_truncation_is_detected() -> None:
    blob, _ = small_blob()
    assert all(decode_fails(blob[:cut]) for cut in range(len(blob)))


def test_truncations_of_a_large_blob_are_detected() -> None:
    blob = encode_blob({"kv": torch.randn(4, 64, 128).to(torch.float16)})
    cuts = random.Random(0).sample(range(len(blob)), 200)
    assert all(decode_fails(blob[:cut]) for cut in cuts)


def test_every_single_bit_flip_is_detected() -> None:
    blob, _ = small_blob()
    damaged = bytearray(blob)
    survivors = []
    for position in range(len(blob)):
        for bit in range(8):
            damaged[position] ^= 1 << bit
            if not decode_fails(bytes(damaged)):
                survivors.append((position, bit))
            damaged[position] ^= 1 << bit
    assert survivors == []


def test_appended_bytes_are_detected() -> None:
    blob, _ = small_blob()
    assert decode_fails(blob + b"\x00")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 8,
        struct.pack("<Q", 2**63) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 4) + b"\xff\xfe{}",
        struct.pack("<Q", 2) + b"{}",  # no checksum
        struct.pack("<Q", 20000) + b"[" * 20000,  # deeply nested JSON
        bytes(random.Random(1).randbytes(4096)),
    ],
    ids=["empty", "zero-header", "huge-header-len", "json-array", "bad-utf8", "no-checksum", "deep-json", "random"],
)
def test_garbage_is_corrupt(data: bytes) -> None:
    assert decode_fails(data)


def test_foreign_safetensors_without_checksum_is_refused() -> None:
    assert decode_fails(safetensors.torch.save({"a": torch.zeros(3)}))


def test_header_lying_about_layout_is_detected_even_with_a_fresh_checksum() -> None:
    blob, _ = small_blob()
    header_len = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + header_len])
    header["ids"]["data_offsets"][1] += 1  # overlapping / out-of-range offsets
    forged = json.dumps(header).encode()
    assert decode_fails(struct.pack("<Q", len(forged)) + forged + blob[8 + header_len :])


def test_encode_validates_inputs() -> None:
    with pytest.raises(TypeError):
        encode_blob({"a": [1, 2, 3]})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        encode_blob({"a": torch.zeros(1)}, {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="reserved"):
        encode_blob({"a": torch.zeros(1)}, {"ragkv.crc32": "x"})
    with pytest.raises(ValueError):
        encode_blob({"": torch.zeros(1)})
    with pytest.raises(ValueError, match="dtype"):
        encode_blob({"a": torch.zeros(1, dtype=torch.complex64)})


def test_a_mac_blob_needs_the_same_secret() -> None:
    _, tensors = small_blob()
    key, other = mac_key_of("deployment secret"), mac_key_of("another secret")
    blob = encode_blob(tensors, {"doc": "d1"}, mac_key=key)
    decoded, metadata = decode_blob(blob, mac_key=key)
    assert metadata == {"doc": "d1"} and all(torch.equal(decoded[name], tensors[name]) for name in tensors)
    for wrong in (other, None):
        with pytest.raises(CorruptBlobError):
            decode_blob(blob, mac_key=wrong)
    with pytest.raises(CorruptBlobError, match="MAC"):
        decode_blob(encode_blob(tensors), mac_key=key)  # a CRC-only blob, as a planter could write it
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with pytest.raises(CorruptBlobError, match="MAC"):
        decode_blob(flipped, mac_key=key)
