"""Where A2ATS codebooks are kept: sub-database ``sparse_codebooks`` of the shared LMDB
environment, key ``a2ats/<model fingerprint>``, value a checksummed safetensors blob."""

from __future__ import annotations

from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.lmdb_env import LMDBEnvironment

CODEBOOK_DB = "sparse_codebooks"


def _key(fingerprint: str) -> bytes:
    return f"a2ats/{fingerprint}".encode()


def save_codebook(env: LMDBEnvironment, fingerprint: str, codebook: A2ATSCodebook) -> None:
    """Store `codebook` as the A2ATS codebook of the model with `fingerprint` (replacing any)."""
    db = env.db(CODEBOOK_DB)
    blob = encode_blob(*codebook.to_tensors())
    env.write(lambda txn: txn.put(_key(fingerprint), blob, db=db))


def load_codebook(env: LMDBEnvironment, fingerprint: str) -> A2ATSCodebook | None:
    """The stored A2ATS codebook of the model with `fingerprint`, or None."""
    db = env.db(CODEBOOK_DB)
    with env.read() as txn:
        raw = txn.get(_key(fingerprint), db=db)
        return None if raw is None else A2ATSCodebook.from_tensors(*decode_blob(raw))


def stored_codebook(engine, env: LMDBEnvironment) -> A2ATSCodebook | None:
    """`engine`'s model's stored codebook (if any), checked against the model's shape."""
    codebook = load_codebook(env, engine.fingerprint)
    if codebook is not None:
        codebook.check_model(engine.spec)
    return codebook
