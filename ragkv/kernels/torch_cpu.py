"""Torch implementations tuned for CPUs, used when no GPU kernel applies.

They compute exactly what the references in kernels/reference.py compute (the tests
compare them), but avoid work the references do for clarity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ROW_GROUPS = 8
_MIN_ROWS_TO_GROUP = 128


def selective_attention(
    q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal-by-position attention, with rows grouped by position so each group reads only
    the cache prefix it can see (a masked square would spend half its work on masked
    entries). 4-D SDPA inputs: torch's CPU fast path does not take 3-D ones."""
    n = q_rows.shape[1]
    if bool((row_positions[1:] < row_positions[:-1]).any()):
        order = torch.argsort(row_positions)
        out = torch.empty_like(q_rows)
        out[:, order] = selective_attention(q_rows[:, order], k_cache, v_cache, row_positions[order], scale)
        return out
    groups = _ROW_GROUPS if n >= _MIN_ROWS_TO_GROUP else 1
    bounds = [round(i * n / groups) for i in range(groups + 1)]
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        if start == end:
            continue
        visible = int(row_positions[end - 1]) + 1
        mask = torch.arange(visible, device=q_rows.device)[None, :] <= row_positions[start:end, None]
        parts.append(F.scaled_dot_product_attention(
            q_rows[None, :, start:end], k_cache[None, :, :visible], v_cache[None, :, :visible],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )[0])
    return torch.cat(parts, dim=1)
