"""Where per-tenant store budgets come from: --store-tenant-budget (every tenant's) and a
key's store_budget_bytes in the API keys file (its tenant's own); bad values are refused
with a message and an exit code before anything starts."""

from __future__ import annotations

import json

import pytest

from ragkv.api.auth import load_key_limits, load_store_budgets
from ragkv.api.config import ServeConfig
from ragkv.api.rate_limits import KeyLimits
from ragkv.app.storage import Storage
from ragkv.app.storage_config import StorageConfig
from ragkv.cli.main import main


def write_keys(tmp_path, entries: dict):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    return path


def test_keys_file_budgets_are_per_tenant_and_leave_the_rate_limits_alone(tmp_path) -> None:
    path = write_keys(
        tmp_path,
        {
            "plain-key-0001": "alpha",
            "budget-key-001": {"tenant": "beta", "store_budget_bytes": 4096, "max_concurrent_requests": 2},
            "budget-key-002": {"tenant": "beta", "store_budget_bytes": 4096},
            "gamma-key-0001": {"tenant": "gamma", "max_requests_per_second": 3},
        },
    )
    assert load_store_budgets(path) == {"beta": 4096}
    assert load_key_limits(path, KeyLimits())["budget-key-001"] == KeyLimits(0.0, 2)
    config = ServeConfig(port=9).with_store_budgets(load_store_budgets(path))
    assert config.runtime.store_tenant_budgets == (("beta", 4096),) and config.port == 9


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"tenant": "beta", "store_budget_bytes": 0}, "store_budget_bytes must be a positive integer"),
        ({"tenant": "beta", "store_budget_bytes": "1GB"}, "store_budget_bytes must be a positive integer"),
        ({"tenant": "beta", "store_budget_bytes": 1.5}, "store_budget_bytes must be a positive integer"),
        ({"tenant": "beta", "store_budget_bytes": True}, "store_budget_bytes must be a positive integer"),
    ],
)
def test_bad_keys_file_budgets_are_refused(tmp_path, entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_store_budgets(write_keys(tmp_path, {"some-key-00001": entry}))


def test_two_budgets_for_one_tenant_are_refused(tmp_path) -> None:
    path = write_keys(
        tmp_path,
        {
            "beta-key-00001": {"tenant": "beta", "store_budget_bytes": 4096},
            "beta-key-00002": {"tenant": "beta", "store_budget_bytes": 8192},
        },
    )
    with pytest.raises(ValueError, match="two store_budget_bytes"):
        load_store_budgets(path)


def test_the_storage_gives_the_lmdb_store_its_budgets(tmp_path) -> None:
    config = StorageConfig(
        data_dir=tmp_path / "data", store_tenant_budget=1 << 20, store_tenant_budgets=(("beta", 4096),)
    )
    with Storage(config) as storage:
        budgets = storage.store.tenant_budgets
        assert (budgets.of("alpha"), budgets.of("beta"), budgets.of("")) == (1 << 20, 4096, 1 << 20)
    with Storage(StorageConfig(data_dir=tmp_path / "data")) as storage:
        assert not storage.store.tenant_budgets.any


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"store_tenant_budget": 0}, "store_tenant_budget must be a positive number of bytes"),
        ({"store_tenant_budgets": (("beta", -1),)}, "store budget of tenant 'beta'"),
        ({"store_tenant_budget": 10, "store_url": "redis+cluster://127.0.0.1:1/"}, "a Redis Cluster chunk store"),
    ],
)
def test_bad_budget_settings_are_refused(tmp_path, fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        StorageConfig(data_dir=tmp_path / "data", **fields)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--store-tenant-budget", "0"], "store_tenant_budget must be a positive number of bytes"),
        (["--store-tenant-budget", "5", "--store", "redis+cluster://127.0.0.1:1/"], "a Redis Cluster chunk store"),
    ],
)
def test_serve_refuses_bad_budget_options_with_a_message(tmp_path, capsys, args, message) -> None:
    assert main(["serve", "--data-dir", str(tmp_path / "data"), *args]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_refuses_a_bad_keys_file_budget_with_a_message(tmp_path, capsys) -> None:
    keys = write_keys(tmp_path, {"some-key-00001": {"tenant": "beta", "store_budget_bytes": -3}})
    assert main(["serve", "--data-dir", str(tmp_path / "data"), "--api-keys", str(keys)]) != 0
    err = capsys.readouterr().err
    assert "store_budget_bytes must be a positive integer" in err and "Traceback" not in err
