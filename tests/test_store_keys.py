"""Chunk keys: validation, byte round trip, token hashing."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from ragkv.store import ChunkKey, hash_tokens, key_prefix
from ragkv.store.keys import tenant_of


def test_key_bytes_round_trip() -> None:
    key = ChunkKey("smollm2-135m.q8_0", "0f" * 16, 3)
    assert key.to_bytes() == b"kv/3/smollm2-135m.q8_0/" + b"0f" * 16
    assert ChunkKey.from_bytes(key.to_bytes()) == key
    assert ChunkKey.from_bytes(memoryview(key.to_bytes())) == key


def test_a_key_names_its_tenant() -> None:
    key = ChunkKey("m", "0f" * 16, 3, "alice")
    assert key.to_bytes() == b"kv/3/m/@alice/" + b"0f" * 16
    assert ChunkKey.from_bytes(key.to_bytes()) == key
    assert tenant_of(key.to_bytes()) == "alice"
    shared = ChunkKey("m", "0f" * 16, 3)
    assert tenant_of(shared.to_bytes()) == "" and ChunkKey.from_bytes(shared.to_bytes()).tenant == ""
    assert key.to_bytes() != shared.to_bytes() != ChunkKey("m", "0f" * 16, 3, "bob").to_bytes()
    assert key.to_bytes().startswith(key_prefix(3, "m"))
    assert tenant_of(b"other/1/m/@alice/h") == ""


@pytest.mark.parametrize("tenant", ["a/b", "x" * 65, "é", None, "a b"])
def test_invalid_tenants_are_rejected(tenant) -> None:
    with pytest.raises(ValueError):
        ChunkKey("m", "ab", 1, tenant)


@pytest.mark.parametrize(
    "fields",
    [
        ("m", "@ab", 1),
        ("", "ab", 1),
        ("a/b", "ab", 1),
        ("m", "ab/c", 1),
        ("m", "ab", 0),
        ("m", "ab", True),
        ("m", "ab", "1"),
        ("m", "x" * 129, 1),
        ("mödel", "ab", 1),
        (None, "ab", 1),
    ],
)
def test_invalid_fields_are_rejected(fields) -> None:
    with pytest.raises(ValueError):
        ChunkKey(*fields)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"kv/",
        b"kv/1/m",
        b"kv/x/m/h",
        b"other/1/m/h",
        b"kv/1/m/h/extra",
        b"kv/0/m/h",
        b"kv/1/m/@/h",
        b"kv/1/m/@a/@h",
        b"kv/1/m/@a/h/x",
    ],
)
def test_malformed_key_bytes_are_rejected(raw: bytes) -> None:
    with pytest.raises(ValueError):
        ChunkKey.from_bytes(raw)


def test_hash_tokens_is_blake2b_of_int32_le() -> None:
    ids = [1, 2, 50_000, -1]
    want = hashlib.blake2b(struct.pack("<4i", *ids), digest_size=16).hexdigest()
    assert hash_tokens(ids) == want and len(want) == 32
    assert hash_tokens(torch.tensor(ids)) == want
    assert hash_tokens([1, 2]) != hash_tokens([2, 1])


def test_hash_tokens_rejects_non_int32() -> None:
    with pytest.raises(ValueError):
        hash_tokens([2**31])
    with pytest.raises(TypeError):
        hash_tokens([1.5])  # type: ignore[list-item]


def test_key_prefix() -> None:
    assert key_prefix() == b"kv/"
    assert key_prefix(2) == b"kv/2/"
    assert key_prefix(2, "m") == b"kv/2/m/"
    assert ChunkKey("m", "ab", 2).to_bytes().startswith(key_prefix(2, "m"))
    assert not ChunkKey("m2", "ab", 2).to_bytes().startswith(key_prefix(2, "m"))
    with pytest.raises(ValueError):
        key_prefix(None, "m")
