"""Generation on the packaged SmolLM2 against transformers generate, and the generation
controls (stop strings, EOS, token limit, seeded sampling, top-p), through the scheduler
step every request decodes in."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ragkv.app.generate import CollectingSink, complete
from ragkv.app.request import FinishReason
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.sampling import Sampler, SamplingConfig

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _generate(engine, config, sink=None):
    return complete(engine, engine.prompt.encode_messages(MESSAGES), config, sink)


def test_greedy_matches_transformers_generate_token_for_token(engine):
    prompt = engine.prompt.encode_messages(MESSAGES)
    reference = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    done = _generate(engine, GenerationConfig(max_new_tokens=24))
    got = done.token_ids
    # transformers keeps the EOS token in its output; the completion's ids end before it.
    assert got == expected[: len(got)]
    assert len(got) == len(expected) or (done.finish_reason is FinishReason.EOS and len(got) == len(expected) - 1)


def test_chat_template_is_applied(engine):
    text = engine.tokenizer.decode(engine.prompt.encode_messages(MESSAGES))
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n")


def test_max_new_tokens_and_finish_reason(engine):
    done = _generate(engine, GenerationConfig(max_new_tokens=3))
    assert len(done.token_ids) == 3 and done.usage.completion_tokens == 3
    assert done.finish_reason is FinishReason.LENGTH


def test_stop_string_ends_generation_and_is_not_returned(engine):
    full = _generate(engine, GenerationConfig(max_new_tokens=24)).text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    sink = CollectingSink()
    done = _generate(engine, GenerationConfig(max_new_tokens=24, stop=(stop,)), sink)
    assert done.finish_reason is FinishReason.STOP
    assert stop not in done.text and done.text == "".join(sink.pieces)
    assert full.startswith(done.text)


def test_streamed_text_equals_decoding_all_tokens(engine):
    sink = CollectingSink()
    done = _generate(engine, GenerationConfig(max_new_tokens=20), sink)
    assert "".join(sink.pieces) == done.text == engine.tokenizer.decode(done.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(engine):
    sampled = SamplingConfig(temperature=1.2, top_p=0.95, seed=7)
    first = _generate(engine, GenerationConfig(max_new_tokens=12, sampling=sampled)).token_ids
    second = _generate(engine, GenerationConfig(max_new_tokens=12, sampling=sampled)).token_ids
    assert first == second
    others = [
        _generate(engine, GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.2, 0.95, seed))).token_ids
        for seed in (8, 9, 10)
    ]
    assert any(other != first for other in others)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.7, seed=0))
    draws = {sampler(logits) for _ in range(300)}
    assert draws == {0, 1}


def test_extreme_sampling_settings_draw_the_argmax():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0 - 1e-3])
    for config in (SamplingConfig(temperature=9.0, top_p=5e-324, seed=0), SamplingConfig(temperature=1e-300, seed=0)):
        assert {Sampler(config)(logits) for _ in range(20)} == {1}
    assert Sampler(SamplingConfig(temperature=0.0, seed=2**64 - 1)).generator is None  # greedy draws nothing


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(seed=2**64), dict(seed=-(2**63) - 1)]
)
def test_bad_sampling_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def test_bad_generation_settings_are_refused():
    with pytest.raises(ValueError):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError):
        GenerationConfig(stop=("",))
