"""Typed choice of a sparse decode selector, its budget and knobs; requests and the CLI
convert to this.

The budget is defined once, here. It counts EVERY cache row a decode step attends to per
KV head: the attention sinks, the recent window (and LRQK's lite rows) and the rows the
selector retrieves. A budget of 0.06 at 8192 cached rows therefore reads 492 rows per KV
head, of which sinks + window = 68 are fixed and 424 are retrieved. When the budget is
smaller than the fixed rows, the fixed rows are still read and nothing is retrieved; when
it covers every row, the step is dense (all rows, exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ragkv.kernels.dispatch import BACKENDS

SELECTOR_NAMES = ("dense", "oracle", "a2ats", "pqcache", "lrqk")
DEFAULT_SELECTOR = "a2ats"


@dataclass(frozen=True)
class SparseConfig:
    selector: str = DEFAULT_SELECTOR
    """One of dense, oracle, a2ats, pqcache, lrqk."""
    budget: float = 0.06
    """Rows attended per KV head per step, sinks and recent window included: a value in
    (0, 1] is a fraction of the cached rows (1.0 = dense), a whole number > 1 a row count."""
    sinks: int = 4
    """First rows (attention sinks) always attended exactly."""
    window: int = 64
    """Most recent rows always attended exactly (also A2ATS's WRoPE window w)."""
    head_aggregation: str = "probs"
    """How a KV head combines its query heads' approximate scores (GQA): 'probs' sums each
    head's softmax over the rows (exact logits for sinks/window in the normaliser), 'logits'
    sums the raw scores (= scoring the group-summed query; a pure table lookup for
    a2ats without mean key and for pqcache, which then run in kernels.code_score_topk)."""
    backend: str = "auto"
    """Kernel backend for scoring and sparse attention: auto, torch, triton, flashinfer."""
    snapkv_capacity: int | None = None
    """SnapKV: after the first token keep this many prompt rows per layer and KV head
    (prefix and question rows always kept); None = no eviction."""
    snapkv_kernel: int = 7
    """SnapKV: max-pool kernel over positions applied to the question window's attention."""
    a2ats_offset: int = 2048
    """A2ATS WRoPE: relative position b at which the query is rotated for keys outside the window."""
    a2ats_mean_key: bool = True
    """A2ATS: score the calibration mean key with its exact RoPE and only the residual
    (k - mean) with WRoPE; False = plain WRoPE on the whole key (the paper's form)."""
    a2ats_codebook_size: int = 1024
    """A2ATS: centroids per layer and KV head when calibrating (the stored codebook decides at query time)."""
    pq_subspaces: int = 2
    """PQCache m: sub-spaces the head dimension is split into."""
    pq_bits: int = 6
    """PQCache: bits per sub-space code (2**bits centroids)."""
    pq_iterations: int = 10
    """PQCache: k-means iterations (bounded; the fit runs once per request after the prefill)."""
    pq_train_rows: int = 4096
    """PQCache: at most this many keys per layer and KV head train the k-means (all are encoded)."""
    lrqk_rank: int = 32
    """LRQK r: rank of the joint query/key factors."""
    lrqk_lite: int = 16
    """LRQK: recent rows beyond the window kept exact (the 'lite' set; counts in the budget)."""
    seed: int = 0
    """Seed of the per-request k-means initialisation (PQCache)."""

    def __post_init__(self) -> None:
        if self.selector not in SELECTOR_NAMES:
            raise ValueError(f"unknown sparse selector {self.selector!r}; choose one of {', '.join(SELECTOR_NAMES)}")
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"budget must be a fraction in (0, 1] or a row count > 1, got {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise ValueError(f"a budget above 1 is a row count and must be whole, got {self.budget}")
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.window < 1:
            raise ValueError("window must be >= 1 (the new token's own row is always attended)")
        if self.head_aggregation not in ("probs", "logits"):
            raise ValueError(f"head_aggregation must be 'probs' or 'logits', got {self.head_aggregation!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.snapkv_capacity is not None and self.snapkv_capacity < 1:
            raise ValueError("snapkv_capacity must be >= 1 when given")
        if self.snapkv_kernel < 1 or self.snapkv_kernel % 2 == 0:
            raise ValueError("snapkv_kernel must be a positive odd number")
        if self.a2ats_offset < 0:
            raise ValueError("a2ats_offset must be >= 0")
        if not 2 <= self.a2ats_codebook_size <= 32767:
            raise ValueError("a2ats_codebook_size must be in [2, 32767] (codes are int16)")
        if self.pq_subspaces < 1:
            raise ValueError("pq_subspaces must be >= 1")
        if not 1 <= self.pq_bits <= 15:
            raise ValueError("pq_bits must be in [1, 15] (codes are int16)")
        if self.pq_iterations < 1 or self.pq_train_rows < 2:
            raise ValueError("pq_iterations must be >= 1 and pq_train_rows >= 2")
        if self.lrqk_rank < 1:
            raise ValueError("lrqk_rank must be >= 1")
        if self.lrqk_lite < 0:
            raise ValueError("lrqk_lite must be >= 0")

    def budget_rows(self, rows: int) -> int:
        """Rows attended per KV head when `rows` are cached (before sinks/window are forced in)."""
        if self.budget <= 1:
            return min(rows, math.ceil(self.budget * rows))
        return min(rows, int(self.budget))

    def build(self, prompt, codebook=None):
        """The DecodeAttention for one request: the selector built on `prompt`
        (a :class:`ragkv.sparse.prompt.PromptState`), after SnapKV eviction when configured."""
        from ragkv.sparse.build import build_decode_attention

        return build_decode_attention(self, prompt, codebook)
