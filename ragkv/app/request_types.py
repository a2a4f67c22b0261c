"""What a request may name: the typed configs a request builds and the names and bounds
they accept. The application's public request surface, for the API to convert requests
into (it imports these from here, not from the engine, fusion, sparse or ingest packages).
"""

from __future__ import annotations

from ragkv.engine.generation import MAX_LOGPROBS, GenerationConfig
from ragkv.engine.sampling import SamplingConfig
from ragkv.fusion import DEFAULT_STRATEGY, STRATEGY_NAMES, FusionConfig
from ragkv.ingest.index.filters import MAX_KEYS as MAX_FILTER_KEYS
from ragkv.ingest.index.filters import MAX_VALUES as MAX_FILTER_VALUES
from ragkv.ingest.index.filters import MetadataFilter
from ragkv.ingest.index.hybrid import DEFAULT_RETRIEVAL, RETRIEVAL_MODES
from ragkv.ingest.registry import check_tenant
from ragkv.sparse import SELECTOR_NAMES, SparseConfig

__all__ = [
    "DEFAULT_RETRIEVAL",
    "DEFAULT_STRATEGY",
    "MAX_FILTER_KEYS",
    "MAX_FILTER_VALUES",
    "MAX_LOGPROBS",
    "RETRIEVAL_MODES",
    "SELECTOR_NAMES",
    "STRATEGY_NAMES",
    "FusionConfig",
    "GenerationConfig",
    "MetadataFilter",
    "SamplingConfig",
    "SparseConfig",
    "check_tenant",
]
