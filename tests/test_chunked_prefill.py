"""Chunked prefill (--max-num-batched-tokens) against whole prefills: the same logits and
cache rows from a prefill cut into pieces, and the same answers, token for token, from an
engine client that steps its preparations in pieces while other requests decode.

The reference is the whole prefill of the same tokens on the same float32 engine (the
numerics the exactness tests use), so a difference is the cutting's, not a format's."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fused_case

from ragkv.app.runtime import RuntimeConfig
from ragkv.app.server.config import ServerConfig
from ragkv.app.server.local import LocalClient
from ragkv.engine import EngineConfig, pacing
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import build_strategy

pytestmark = pytest.mark.model

TEXT = (
    "The lighthouse at Gull Point was built in 1851 by the harbour board; its lantern room was rebuilt "
    "in 1890 after a fire, and the town's archive keeps the plans and the keepers' letters. "
)


class FixedPieces:
    """A pacer that cuts every prefill into pieces of `size` tokens and counts them."""

    def __init__(self, size: int):
        self.size = size
        self.pieces: list[int] = []

    def piece_tokens(self, start: int) -> int:
        return self.size

    def spent(self, tokens: float, context: float) -> None:
        self.pieces.append(int(tokens))


def _prompt_ids(engine, repeats: int) -> torch.Tensor:
    return torch.tensor(engine.tokenizer.encode(TEXT * repeats), dtype=torch.long)


@pytest.mark.parametrize("size", [1, 7, 64, 333])
def test_a_prefill_in_pieces_gives_the_whole_prefills_logits_and_rows(engine, size):
    """Pieces of 1 and 7 tokens go through the compiled decoder's extend, 64 and 333 through
    the layer-by-layer prefill: each appends after the rows before it."""
    ids = _prompt_ids(engine, 6)[:450]
    whole = engine.model.new_cache(ids.numel() + 4)
    reference = engine.model.prefill(ids, whole)
    cut = engine.model.new_cache(ids.numel() + 4)
    pacer = FixedPieces(size)
    with pacing.paced(pacer):
        logits = engine.model.prefill(ids, cut)
    assert sum(pacer.pieces) == ids.numel() and len(pacer.pieces) == -(-ids.numel() // size)
    assert cut.length == whole.length == ids.numel()
    assert torch.allclose(logits, reference, atol=2e-3, rtol=0), (logits - reference).abs().max()
    assert int(logits.argmax()) == int(reference.argmax())
    for layer in range(engine.model.spec.num_layers):
        k_cut, v_cut = cut.layer(layer, ids.numel())
        k_whole, v_whole = whole.layer(layer, ids.numel())
        assert torch.allclose(k_cut, k_whole, atol=1e-3, rtol=0), (layer, (k_cut - k_whole).abs().max())
        assert torch.allclose(v_cut, v_whole, atol=1e-3, rtol=0), (layer, (v_cut - v_whole).abs().max())


@pytest.mark.parametrize(
    "spec",
    ["probe", "a3", "epic", "cacheblend:ratio=1", "probe:escalate_kl=1e-12", "probe:refresh_ratio=0.1,draft_tokens=4"],
)
def test_a_fusion_in_pieces_of_rows_gives_the_whole_fusions_logits_and_rows(engine, spec):
    """Pieces of one token's work: 30 rows of each layer at a time (several per layer, the
    check layer's selection before them), against the same fusion with no pacer."""
    fusion_input, _ = fused_case(engine)
    strategy = build_strategy(spec)
    whole = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    pacer = FixedPieces(1)
    with pacing.paced(pacer):
        cut = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    layers = engine.model.spec.num_layers
    assert len(pacer.pieces) > 1.5 * layers  # more pieces than layers: layers were cut by rows
    assert torch.equal(cut.final_rows, whole.final_rows)
    torch.testing.assert_close(cut.logits, whole.logits, atol=2e-4, rtol=0)
    rows = whole.layout.length
    torch.testing.assert_close(cut.cache.keys[:, :, :rows], whole.cache.keys[:, :, :rows], atol=2e-4, rtol=0)
    torch.testing.assert_close(cut.cache.values[:, :, :rows], whole.cache.values[:, :, :rows], atol=2e-4, rtol=0)


def test_the_escalated_pass_is_paced_too(engine):
    """The probe's second pass (escalation) runs in the pacer's pieces as its first does: a
    long pass beside running answers must not stall them."""
    fusion_input, _ = fused_case(engine)
    counts = {}
    for threshold in (0.0, 1e-12):
        pacer = FixedPieces(1)
        with pacing.paced(pacer):
            result = build_strategy(f"probe:min_rows=0,escalate_kl={threshold}").fuse(
                engine.model, fusion_input, engine.chunk_prefix_cache()
            )
        counts[threshold] = len(pacer.pieces)
    assert result.selection["escalated"] == 1.0
    assert counts[1e-12] > counts[0.0] + 1.5 * engine.model.spec.num_layers


def test_no_pacer_means_one_whole_prefill(engine):
    ids = _prompt_ids(engine, 2)
    assert pacing.current() is None
    cache = engine.model.new_cache(ids.numel())
    engine.model.prefill(ids, cache)
    assert cache.length == ids.numel()


def _answers(tmp_path, budget: int, prompts: list[str]) -> tuple[list[list[list[int]]], int]:
    """Greedy token ids of `prompts` sent together (one request each, so the short ones decode
    while the long one prepares): a cold prefill, then twice with pasted passages over one
    data folder (the first stores them, the second reuses them, so its fusion's recompute
    runs in pieces too); and the steps that ran a piece of a preparation."""
    config = ServerConfig(
        runtime=RuntimeConfig(
            data_dir=tmp_path / f"budget-{budget}",
            engine=EngineConfig(weights="float32", prefill_weights="float32", kv_cache_dtype="float32"),
        ),
        max_num_batched_tokens=budget,
    )
    generation = GenerationConfig(max_new_tokens=24)
    out = []
    with LocalClient(config) as local:
        for prompt_spans in (False, True, True):
            done = local.complete(prompts, generation, prompt_spans=prompt_spans)
            out.append([list(d.token_ids) for d in done])
        pieces = local.client.stats().scheduler.prefill_pieces
    return out, pieces


def test_answers_with_chunked_prefill_are_the_whole_prefills(tmp_path):
    """A cold prompt and a pasted one, its passages stored then reused, beside two short
    prompts decoding: the same tokens whether the long preparation ran whole or in pieces."""
    passages = [
        f"Passage {i}: " + TEXT.replace("Gull Point", name) * 4
        for i, name in enumerate(["Gull Point", "Marrow Creek", "Saltmarsh", "Linden Hill"])
    ]
    long_prompt = (
        "Answer from the passages.\n\n" + "\n\n".join(passages) + "\n\nQuestion: When was the lantern rebuilt?\nAnswer:"
    )
    prompts = ["The harbour board met on", "Keepers wrote letters about", long_prompt]
    whole, whole_pieces = _answers(tmp_path, 0, prompts)
    chunked, chunked_pieces = _answers(tmp_path, 48, prompts)
    # the long prompt is ~600 tokens: its two prefills (cold, then pasted and stored) alone
    # take over 20 pieces of the 48-token budget less the two decode rows
    assert whole_pieces == 0 and chunked_pieces >= 20, chunked_pieces
    assert all(len(ids) >= 8 for round_ in whole for ids in round_)  # answers, not an early end
    assert chunked == whole
