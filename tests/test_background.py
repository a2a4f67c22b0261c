"""Background writer threads run at a lower priority than the model thread (Linux)."""

import os
import sys
import threading

import pytest
import torch

from ragkv.store.background import BACKGROUND_NICENESS, lower_this_thread
from ragkv.store.keys import ChunkKey
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.write_behind import WriteBehindStore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice_of(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def test_a_lowered_thread_gets_a_higher_nice_value_and_the_caller_keeps_its_own():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def body():
        seen["lowered"] = lower_this_thread()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["lowered"]
    assert seen["nice"] == min(19, mine + BACKGROUND_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_write_behind_thread_runs_lowered(tmp_path):
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    behind = WriteBehindStore(LMDBStore(tmp_path / "store"))
    try:
        behind.put(ChunkKey("fp", "c", 1), {"tokens": torch.arange(3)})
        behind.flush()  # written by its loop, which lowered itself first
        assert _nice_of(behind._thread) == min(19, mine + BACKGROUND_NICENESS)
    finally:
        behind.close()
