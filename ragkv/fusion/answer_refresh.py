"""The probe's refresh for the answer (`probe:refresh_ratio=...`): a second, smaller
selective pass chosen by where the answer reads, not the question.

The probe picks the document rows the question attends to; the answer's later tokens then
read rows that pick left stale (placed from the store, never recomputed with the other
chunks). After the probe's fuse, `draft_tokens` tokens are decoded greedily over the fused
cache, and one pass of those draft rows through every layer records how their attention
spreads over the document rows (normalised to 1 per layer, as the probe's own scores are,
so every layer has an equal vote). The stale rows with the highest score are recomputed
from layer 0 together with the question rows, reading the fused cache (so they see the
rows the probe already recomputed), and the draft rows are dropped: the cache ends at the
prompt, and the logits are the last question row's after the refresh.

By default the rows the probe recomputed are not run again: their K/V read the refreshed
rows while still stale, which costs less than running them twice; `refresh_rerun` runs
them again in the refresh pass. With the probe's own budget at 0 (or with the rerun) and
the refresh covering every row, every document row and the question are computed in one
causal pass after an exact prefix, which is the full prefill.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ragkv.engine import pacing
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM
from ragkv.fusion.base import FusionResult, finish_in_pieces, mean_position, ratio_budget, top_k_rows
from ragkv.fusion.layout import Layout
from ragkv.fusion.probe import attention_shares_by_layer


@torch.inference_mode()
def refresh_for_answer(
    model: CausalLM,
    result: FusionResult,
    ratio: float,
    draft_tokens: int,
    columns: torch.Tensor | None,
    rerun: bool = False,
) -> FusionResult:
    """`result` with the top `ratio` share of its reused document rows, among those it left
    stale, recomputed by the drafts' attention (see the module docstring); `columns` are the
    rows the recomputed document rows read (the strategy's `document_columns`); `rerun`:
    the document rows `result` recomputed run again with them."""
    started = time.perf_counter()
    layout, cache = result.layout, result.cache
    recomputed = result.final_rows.cpu()
    reused = layout.reused_document_rows
    stale = reused[~torch.isin(reused, recomputed)]
    budget = min(ratio_budget(ratio, layout), stale.numel())
    report = {"refreshed_share": 0.0, "draft_tokens": 0.0, "refresh_covered": 0.0}
    if budget <= 0:
        return dataclasses.replace(result, selection={**result.selection, **report})
    drafts = greedy_drafts(model, cache, result.logits, draft_tokens)
    shares = draft_attention_by_layer(model, cache, layout, drafts)
    scores = shares.sum(dim=0).cpu()[stale - layout.prefix_len]
    chosen = stale[top_k_rows(scores, budget).cpu()]
    rows = torch.cat((chosen, layout.question_rows))
    if rerun:  # the probe's rows again, after the refreshed ones changed
        rows = torch.cat((rows, recomputed[torch.isin(recomputed, reused)])).unique(sorted=True)
    rows = rows.to(model.device)
    logits = recompute(model, cache, layout, rows, columns)
    every = torch.cat((result.final_rows, rows)).unique(sorted=True)
    report["refreshed_share"] = chosen.numel() / max(1, layout.num_reused_document_tokens)
    report["draft_tokens"] = float(len(drafts))
    report["refresh_covered"] = float(scores[torch.isin(stale, chosen)].sum() / scores.sum().clamp_min(1e-12))
    return dataclasses.replace(
        result,
        logits=logits,
        recomputed_tokens=result.recomputed_tokens + chosen.numel(),
        reused_tokens=result.reused_tokens - chosen.numel(),
        initial_rows=every,
        final_rows=every,
        timings={**result.timings, "refresh": time.perf_counter() - started},
        selection={**result.selection, **report},
    )


@torch.inference_mode()
def greedy_drafts(model: CausalLM, cache: KVCache, logits: torch.Tensor, count: int) -> list[int]:
    """Up to `count` greedy tokens after the prompt in `cache` (its first from `logits`),
    stopping before an end-of-sequence token; the cache is left at the prompt."""
    length = cache.length
    eos = set(model.spec.eos_token_ids)
    drafts: list[int] = []
    try:
        token = int(logits.argmax())
        while token not in eos:
            drafts.append(token)
            if len(drafts) == count:
                break
            token = int(model.decode_step(token, cache).argmax())
    finally:
        cache.truncate(length)
    return drafts


@torch.inference_mode()
def draft_attention_by_layer(model: CausalLM, cache: KVCache, layout: Layout, drafts: list[int]) -> torch.Tensor:
    """[layers, document tokens]: the share of the draft rows' attention (summed over rows
    and heads) each document token receives at each layer, the drafts placed after the
    prompt in `cache`. The cache is left at the prompt."""
    length = layout.length
    if not drafts:
        return torch.zeros(model.spec.num_layers, layout.num_document_tokens)
    cache.reserve(length + len(drafts))
    rows = torch.arange(length, length + len(drafts), device=model.device)
    tokens = torch.tensor(drafts, device=model.device)
    return attention_shares_by_layer(model, cache, layout, tokens, rows)[0]


@torch.inference_mode()
def recompute(
    model: CausalLM, cache: KVCache, layout: Layout, rows: torch.Tensor, columns: torch.Tensor | None
) -> torch.Tensor:
    """Run `rows` (ascending, ending with the last question row) from layer 0 over `cache`,
    writing their K/V at every layer; the last row's next-token logits. Paced as the fuse
    is: under a scheduler's pacer each layer runs in the pieces it sizes, so running
    answers keep stepping beside a long second pass."""
    hidden = model.embed(layout.token_ids.to(model.device)[rows])
    context = mean_position(rows)
    for layer in range(model.spec.num_layers):
        projection = model.project(layer, hidden, rows)
        cache.keys[layer, :, rows] = projection.k
        cache.values[layer, :, rows] = projection.v
        if layer + 1 == model.spec.num_layers:
            hidden = model.finish_last_row(layer, hidden, projection, rows, cache, layout.length)
            pacing.spent(rows.numel() / model.spec.num_layers, context)
        else:
            hidden = finish_in_pieces(model, layer, projection, rows, hidden, cache, layout, columns, context)
    return model.logits(hidden[-1:])[0]
