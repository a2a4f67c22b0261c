"""LMDB-specific behaviour: persistence, automatic map growth, the shared environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from ragkv.store import ChunkKey, LMDBEnvironment, LMDBStore, StoreError, hash_tokens, open_store

MIB = 1 << 20


def key(i: int) -> ChunkKey:
    return ChunkKey("model-a", hash_tokens([i]), 1)


def chunk(mib: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 255, (int(mib * MIB),), generator=g, dtype=torch.uint8)}


def test_data_survives_close_and_reopen(tmp_path) -> None:
    path = tmp_path / "kv"
    want = {"k": torch.randn(2, 4, 16, 8).half(), "v": torch.randn(2, 4, 16, 8).half()}
    with LMDBStore(path) as store:
        store.put(key(1), want, {"doc": "a"})
    with open_store(f"lmdb://{path}") as reopened:
        entry = reopened.get_entry(key(1))
        assert entry.metadata == {"doc": "a"}
        assert all(torch.equal(entry.tensors[n], want[n]) for n in want)
        assert reopened.stats().entries == 1


def test_tiny_map_grows_for_a_large_transaction(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv", map_size=MIB) as store:
        chunks = [(key(i), chunk(4, i)) for i in range(5)]  # 20 MiB in one write transaction
        store.put_many(chunks)
        assert store._env.map_size >= 20 * MIB
        got = store.get_many([k for k, _ in chunks])
        assert all(torch.equal(g["kv"], c["kv"]) for g, (_, c) in zip(got, chunks))


def test_concurrent_writers_share_map_growth(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv", map_size=MIB) as store:
        failures: list[BaseException] = []

        def writer(thread: int) -> None:
            try:
                for i in range(6):
                    store.put(key(thread * 100 + i), chunk(0.25, i))
                    assert store.get(key(thread * 100 + i)) is not None
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert failures == []
        assert store.stats().entries == 24


def test_readers_are_not_blocked_by_an_open_write(tmp_path) -> None:
    with LMDBStore(tmp_path / "kv") as store:
        store.put(key(1), {"a": torch.ones(3)})
        inside, release = threading.Event(), threading.Event()

        def slow_write(txn) -> None:
            inside.set()
            release.wait(timeout=10)

        writer = threading.Thread(target=store._env.write, args=(slow_write,))
        writer.start()
        try:
            assert inside.wait(timeout=10)
            assert store.get(key(1))["a"].tolist() == [1.0, 1.0, 1.0]  # while the write txn is open
        finally:
            release.set()
            writer.join(timeout=10)


def test_environment_is_shared_per_path_with_named_databases(tmp_path) -> None:
    path = tmp_path / "kv"
    store = LMDBStore(path)
    env = LMDBEnvironment(os.path.join(tmp_path, ".", "kv"))  # same directory, other spelling
    docs = env.db("documents")
    env.write(lambda txn: txn.put(b"doc/1", b"hello", db=docs))
    store.put(key(1), {"a": torch.zeros(1)})
    store.close()  # the environment stays open for the other handle
    with env.read() as txn:
        assert bytes(txn.get(b"doc/1", db=docs)) == b"hello"
        assert txn.get(key(1).to_bytes(), db=docs) is None  # sub-databases are separate
    env.close()
    env.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        env.db("documents")
    with LMDBStore(path) as again:  # reopening after the last handle closed works
        assert again.get(key(1)) is not None


def test_write_aborts_on_error_and_write_in_read_cannot_grow(tmp_path) -> None:
    with LMDBEnvironment(tmp_path / "kv", map_size=MIB) as env:
        db = env.db("t")

        def failing(txn) -> None:
            txn.put(b"a", b"1", db=db)
            raise KeyError("boom")

        with pytest.raises(KeyError):
            env.write(failing)
        with env.read() as txn:
            assert txn.get(b"a", db=db) is None
            with pytest.raises(RuntimeError, match="transaction open"):
                env.write(lambda w: w.put(b"big", os.urandom(2 * MIB), db=db))


def test_growth_by_another_process_is_adopted(tmp_path) -> None:
    path = tmp_path / "kv"
    with LMDBStore(path, map_size=MIB) as store:
        store.put(key(1), {"a": torch.zeros(1)})
        grow = (
            "import lmdb, os, sys\n"
            "env = lmdb.open(sys.argv[1], map_size=64 << 20, max_dbs=16)\n"
            "db = env.open_db(b'other')\n"
            "with env.begin(write=True) as txn:\n"
            "    txn.put(b'x', os.urandom(8 << 20), db=db)\n"
        )
        subprocess.run([sys.executable, "-c", grow, str(path)], check=True, timeout=60)
        store.put(key(2), chunk(1, 2))
        assert store.get(key(1)) is not None and store.get(key(2)) is not None
