"""What a pass over prompt rows costs, in tokens of short-context work, so a step's token
budget buys the same time early in a long prompt as late in it.

A token's weights cost the same at any position; its attention grows with the rows before
it. On a GPU the weights dominate at the context lengths served, so vLLM counts raw tokens;
on a CPU a small model's attention over a 6K-token context costs more than its weights (for
SmolLM2-135M they are even near 3K rows), so a budget of raw tokens would let a piece late
in the prompt take twice the time of the first. `PassCost.of(spec)` derives the ratio from
the model's shapes: multiply-adds per token of the layer weights against those of
attention per context row (QK and PV); sliding-window layers (Gemma 3) see at most their
window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.engine.model_spec import ModelSpec


@dataclass(frozen=True)
class PassCost:
    context_scale: float
    """Context rows at which a token's attention costs as much as its weights (global layers)."""
    windowed_share: float = 0.0
    """Share of layers with a sliding window (their context is at most `window`)."""
    window: int = 0

    def __post_init__(self) -> None:
        if not self.context_scale > 0:
            raise ValueError(f"context_scale must be > 0, got {self.context_scale}")
        if not 0 <= self.windowed_share <= 1 or self.window < 0:
            raise ValueError("windowed_share must be in [0, 1] and window >= 0")

    @classmethod
    def of(cls, spec: ModelSpec) -> PassCost:
        q = spec.num_heads * spec.head_dim
        kv = spec.num_kv_heads * spec.head_dim
        weights = spec.hidden_size * (2 * q + 2 * kv) + 3 * spec.hidden_size * spec.intermediate_size
        windowed = sum(1 for kind in spec.layer_types if kind == "sliding_attention")
        share = windowed / spec.num_layers if spec.sliding_window and spec.layer_types else 0.0
        return cls(weights / (2 * q), share, spec.sliding_window or 0)

    def _context(self, rows: float) -> float:
        """Rows attended on average over the layers, for a token after `rows` rows."""
        local = min(rows, self.window) if self.windowed_share else rows
        return (1 - self.windowed_share) * rows + self.windowed_share * local

    def cost(self, tokens: float, context: float) -> float:
        """`tokens` rows attending to `context` rows each, on average."""
        return tokens * (1 + self._context(context) / self.context_scale)

    def tokens_within(self, work: float, start: int) -> int:
        """The most tokens from `start` whose cost fits `work` (at least one)."""
        low, high = 1, max(1, int(work))
        while low < high:  # cost grows with tokens: the largest that fits
            middle = (low + high + 1) // 2
            if self.cost(middle, start + middle / 2) <= work:  # each attends to the rows before it
                low = middle
            else:
                high = middle - 1
        return low
