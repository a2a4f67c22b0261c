"""The probe's escalation (`probe:escalate_kl=...`): a fuse whose first token moved much
under its recompute is recomputed further.

The probe's selection pass runs the question over the placed cache, so it sees the first
token's distribution before any document row is recomputed (`Preview.logits`). When the
recompute of the top `ratio` rows moves that distribution by more than `escalate_kl`, the
answer leans on stale rows more than that share mends, and the rows left stale may move it
as much again. The two are compared over the same rows: where the pass could not read
them all (new passages not computed yet, the middle of a long conversation), the question
runs once more over the fused cache with the pass's columns, and its own K/V are put back.

Where the question comes after its passages, the passages' rows in the full
prefill never read it and a tenth of them mends the first token; where it comes before
(LangChain's hub prompt), every passage row of the full prefill read the question, and the
rows carry the question of the prompt that stored them.

Escalated, the top `ratio` share of the reused document rows by the probe's own scores
(the `Preview.scores` of its pass) is recomputed from layer 0 in one pass with the question
rows, the rows the first recompute chose among them, so every recomputed row reads the
others' new K/V as in a single pass at that ratio. The cost then is the first pass's rows
and the escalated ones; prompts the first recompute barely moves pay only the preview's
last-row finish.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ragkv.engine.model import CausalLM
from ragkv.fusion.answer_refresh import recompute
from ragkv.fusion.base import FusionResult, ratio_budget, top_k_rows
from ragkv.fusion.fidelity import next_token_kl


@torch.inference_mode()
def escalate_if_moved(
    model: CausalLM, result: FusionResult, threshold: float, ratio: float, columns: torch.Tensor | None
) -> FusionResult:
    """`result`, or when its logits moved by more than `threshold` (KL, nats) from its
    preview's, the fuse with the top `ratio` of its reused document rows recomputed (see the
    module docstring); `columns` are the rows the recomputed document rows read."""
    preview, layout = result.preview, result.layout
    if preview.logits is None or preview.scores is None:
        return result
    reused = layout.reused_document_rows
    budget = ratio_budget(ratio, layout)
    recomputed = result.final_rows.cpu()
    if budget <= int(torch.isin(reused, recomputed).sum()):  # no more to recompute (a whole pass)
        return result
    moved = next_token_kl(_after(model, result), preview.logits)
    report = {**result.selection, "preview_kl": moved, "escalated": 0.0}
    if moved <= threshold:
        return dataclasses.replace(result, selection=report)
    started = time.perf_counter()
    chosen = reused[top_k_rows(preview.scores.cpu(), budget).cpu()]
    rows = torch.cat((chosen, recomputed[torch.isin(recomputed, reused)], layout.question_rows)).unique(sorted=True)
    logits = recompute(model, result.cache, layout, rows.to(model.device), columns)
    every = torch.cat((result.final_rows.cpu(), rows)).unique(sorted=True).to(result.final_rows.device)
    documents = int(torch.isin(reused, every.cpu()).sum())
    report["escalated"] = 1.0
    report["recomputed_share"] = documents / max(1, layout.num_reused_document_tokens)
    return dataclasses.replace(
        result,
        logits=logits,
        recomputed_tokens=documents,
        reused_tokens=layout.num_reused_document_tokens - documents,
        initial_rows=every,
        final_rows=every,
        timings={**result.timings, "escalate": time.perf_counter() - started},
        selection=report,
    )


def _after(model: CausalLM, result: FusionResult) -> torch.Tensor:
    """The first token's logits after the recompute, over the rows the preview read."""
    if result.preview.columns is None:
        return result.logits
    # imported here: probe imports this module's caller
    from ragkv.fusion.probe import attention_shares_by_layer

    layout, cache = result.layout, result.cache
    rows = layout.question_rows.to(model.device)
    keys, values = cache.keys[:, :, rows].clone(), cache.values[:, :, rows].clone()
    try:
        ids = layout.token_ids.to(model.device)[rows]
        return attention_shares_by_layer(model, cache, layout, ids, rows, result.preview.columns, with_logits=True)[2]
    finally:
        cache.keys[:, :, rows], cache.values[:, :, rows] = keys, values
