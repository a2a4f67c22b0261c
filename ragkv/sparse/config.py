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
from dataclasses import dataclass, field

import torch

from ragkv.kernels.dispatch import BACKENDS
from ragkv.sparse.base import SelectorOptions
from ragkv.sparse.registry import DEFAULT_SELECTOR, selector_options
from ragkv.sparse.snapkv import SnapKV

SNAPKV_DEFAULT_KERNEL = 7


@dataclass(frozen=True)
class SparseConfig:
    selector: str = DEFAULT_SELECTOR
    """Selector spec: a name (dense, oracle, a2ats, pqcache, lrqk) or name:option=value,...
    (e.g. a2ats:mean_key=false, pqcache:bits=8); the options are the selector's own fields."""
    budget: float = 0.06
    """Rows attended per KV head per step, sinks and recent window included: a value in
    (0, 1] is a fraction of the cached rows (1.0 = dense), a whole number > 1 a row count."""
    sinks: int = 4
    """First rows (attention sinks) always attended exactly."""
    window: int = 64
    """Most recent rows always attended exactly (also A2ATS's WRoPE window w)."""
    head_aggregation: str | None = None
    """How a KV head combines its query heads' approximate scores (GQA): 'probs' sums each
    head's softmax over the rows (exact logits for sinks/window in the normaliser), 'logits'
    sums the raw scores (= scoring the group-summed query; a pure table lookup for
    a2ats without mean key and for pqcache, which then run in kernels.code_score_topk).
    None = the selector's default: 'logits' for a2ats (measured faster at recall >= 0.9),
    'probs' for the others."""
    backend: str = "auto"
    """Kernel backend for scoring and sparse attention: auto, torch, triton, flashinfer."""
    snapkv_capacity: int | None = None
    """SnapKV: after the first token keep this many prompt rows per layer and KV head
    (prefix and question rows always kept); None = no eviction."""
    snapkv_kernel: int = SNAPKV_DEFAULT_KERNEL
    """SnapKV: max-pool kernel over positions applied to the question window's attention."""
    options: SelectorOptions = field(init=False, repr=False, compare=False)
    """The selector's own options, parsed from the spec."""
    eviction: SnapKV | None = field(init=False, repr=False, compare=False)
    """SnapKV's settings when eviction is on."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", selector_options(self.selector))
        if not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"budget must be a fraction in (0, 1] or a row count > 1, got {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise ValueError(f"a budget above 1 is a row count and must be whole, got {self.budget}")
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.window < 1:
            raise ValueError("window must be >= 1 (the new token's own row is always attended)")
        if self.head_aggregation not in (None, "probs", "logits"):
            raise ValueError(f"head_aggregation must be 'probs' or 'logits', got {self.head_aggregation!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.snapkv_capacity is None and self.snapkv_kernel != SNAPKV_DEFAULT_KERNEL:
            raise ValueError("snapkv_kernel applies to SnapKV eviction: give snapkv_capacity as well")
        eviction = None if self.snapkv_capacity is None else SnapKV(self.snapkv_capacity, self.snapkv_kernel)
        object.__setattr__(self, "eviction", eviction)

    @property
    def aggregation(self) -> str:
        """head_aggregation, or the selector's default when it is unset."""
        return self.head_aggregation or self.options.default_head_aggregation

    @property
    def name(self) -> str:
        """The selector's registered name (the spec without its options)."""
        return self.options.name

    def check_dtype(self, dtype: torch.dtype) -> None:
        """ValueError for a model/cache dtype this configuration cannot decode in."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"sparse decode runs in float32, bfloat16 or float16, not {dtype}")
        if self.backend == "flashinfer" and dtype == torch.float32:
            raise ValueError(
                "the flashinfer backend decodes float16/bfloat16 caches only; use --dtype bfloat16 "
                "or backend auto/torch/triton for float32"
            )

    def budget_rows(self, rows: int) -> int:
        """Rows attended per KV head when `rows` are cached (before sinks/window are forced in)."""
        if self.budget <= 1:
            return min(rows, math.ceil(self.budget * rows))
        return min(rows, int(self.budget))

    def build(self, prompt, codebook=None):
        """The DecodeAttention for one request: the selector built on `prompt`
        (a :class:`ragkv.sparse.prompt.PromptState`), after SnapKV eviction when configured.
        Call it once the first token's logits exist and before the first decode step:
        that is 'after the first token'."""
        self.check_dtype(prompt.cache.keys.dtype)
        if self.eviction is not None and prompt.model.spec.sliding_layers:
            raise ValueError(
                f"SnapKV eviction is not available for {prompt.model.spec.family}: it compacts the cache, so rows no "
                "longer sit at their positions, and the sliding-window layers find their window by row"
            )
        selector = self.options.attach(self, prompt, codebook)
        if self.eviction is not None and self.eviction.capacity < prompt.length:
            kept = self.eviction.evict(prompt)
            selector.compact(kept, prompt.cache.next_position)
        return selector
