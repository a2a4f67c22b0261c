"""Which chunk store a data folder's registry was last used with.

The registry and the chunk store are opened from separate settings, so one registry can
meet a store that holds none of its chunks (`--store` pointed somewhere new). Ingestion
then fills what is missing (pipeline.Ingestor) and questions recompute it, but the user
should hear why: the data folder remembers the last store it wrote with and a change is
logged as a warning."""

from __future__ import annotations

import logging
import re

from ragkv.store.lmdb_env import LMDBEnvironment

log = logging.getLogger("ragkv.ingest")

_DB = "ingest_meta"
_KEY = b"store_url"
_PASSWORD = re.compile(r"(//[^/:@]*:)[^@/]*@")


def shown_url(url: str) -> str:
    """The URL with any password masked (it is stored and logged)."""
    return _PASSWORD.sub(r"\1***@", url)


def check_store(env: LMDBEnvironment, store_url: str, *, record: bool = True) -> str | None:
    """The store the registry was used with before, when it is not `store_url` (a warning
    is logged); None when it is the same or none was noted. `record` notes `store_url`."""
    db = env.db(_DB)
    current = shown_url(store_url)
    with env.read() as txn:
        raw = txn.get(_KEY, db=db)
        previous = bytes(raw).decode() if raw is not None else None
    if record and previous != current:
        env.write(lambda txn: txn.put(_KEY, current.encode(), db=db))
    if previous is None or previous == current:
        return None
    log.warning(
        "the document registry was last used with the chunk store %s, now with %s: chunks ingested through "
        "the other store are not in this one (ingesting the documents again fills it; until then questions "
        "recompute them)",
        previous,
        current,
    )
    return previous
