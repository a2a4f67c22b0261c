"""Each tenant's chunk-store figures on a live `ragkv serve` (/metrics, labelled `tenant`),
and a tenant's store budget from the API keys file bounding that tenant alone. The bytes
/metrics reports are checked against a full scan of the server's LMDB store, read from
here (LMDB lets another process read while the server writes)."""

from __future__ import annotations

import re
import time

import httpx
import lmdb
import openai
import pytest

from ragkv.store.keys import tenant_of
from ragkv.store.lmdb_env import MAX_DBS
from ragkv.store.lmdb_store import CHUNKS_DB

pytestmark = pytest.mark.model

PASSAGES = [
    f"The {name} guild met every {day} in the {hall}; its members kept ledgers of {goods} and "
    f"settled disputes over weights, prices and the right to trade at the {market} market. " * 6
    for name, day, hall, goods, market in (
        ("weavers'", "Tuesday", "old corn exchange", "wool and linen", "spring"),
        ("coopers'", "Thursday", "river warehouse", "barrels and staves", "harbour"),
        ("glaziers'", "Monday", "chapel vestry", "sheet glass", "cathedral"),
        ("tanners'", "Friday", "east gatehouse", "hides and bark", "cattle"),
    )
]
TENANTS = ("store-free", "store-budget")  # the second's keys-file entry gives it a budget of one byte
FIGURE = re.compile(r'^ragkv_store_tenant_(\w+?)(?:_total)?\{tenant="([^"]*)"\} (\S+)$', re.M)


def stuffed(order: list[int]) -> list[dict]:
    documents = "\n\n".join(PASSAGES[i] for i in order)
    return [{"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: Which guild met on Mondays?"}]


def figures(url: str) -> dict[str, dict[str, float]]:
    """tenant -> {bytes, hits, misses, evictions} as /metrics reports them."""
    found: dict[str, dict[str, float]] = {}
    for name, tenant, value in FIGURE.findall(httpx.get(url + "/metrics", timeout=30).text):
        found.setdefault(tenant, {})[name] = float(value)
    return found


def settled(url: str) -> dict[str, dict[str, float]]:
    """The figures once every passage the requests computed is written (written behind)."""
    last, deadline = None, time.monotonic() + 120
    while time.monotonic() < deadline:
        now = figures(url)
        if now == last and all(now.get(t, {}).get("bytes", 0) > 0 for t in TENANTS):
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"the store's figures never settled: {last}")


def scanned(data_dir) -> dict[str, int]:
    """Bytes per tenant from a full scan of the server's chunk store: the reference."""
    env = lmdb.open(str(data_dir / "db"), readonly=True, max_dbs=MAX_DBS)
    try:
        db = env.open_db(CHUNKS_DB.encode())
        totals: dict[str, int] = {}
        with env.begin(db=db) as txn:
            for key, value in txn.cursor():
                totals[tenant_of(key)] = totals.get(tenant_of(key), 0) + len(value)
        return totals
    finally:
        env.close()


def test_each_tenants_store_figures_are_on_metrics_and_a_budget_bounds_its_tenant_alone(shared_server):
    for tenant in TENANTS:
        client = openai.OpenAI(
            base_url=shared_server.url + "/v1", api_key=shared_server.key[tenant], max_retries=0, timeout=600.0
        )
        for order in ([0, 1], [2, 3]):  # the same passages for both tenants, under their own salts
            client.chat.completions.create(model="ragkv", messages=stuffed(order), max_tokens=2)
    found = settled(shared_server.url)
    free, budget = found["store-free"], found["store-budget"]
    assert free["evictions"] == 0 and budget["evictions"] > 0
    assert 0 < budget["bytes"] < free["bytes"]  # the budgeted tenant keeps its last write only
    assert free["misses"] > 0 and budget["misses"] > 0  # its pasted passages were looked up first
    held = scanned(shared_server.data_dir)
    assert (held["store-free"], held["store-budget"]) == (free["bytes"], budget["bytes"])
