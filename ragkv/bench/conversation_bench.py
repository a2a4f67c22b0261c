"""`ragkv bench conversation`: what a chat follow-up costs when its retrieval brings one new
chunk into a long conversation.

Per context size: turn 1 asks about a document of about that many tokens (retrieval
restricted to it, all of its chunks); each follow-up resends the whole history and
restricts retrieval to one short new document (one chunk), so the turn fuses exactly one
new chunk after the cached conversation. Reported per follow-up: the server-side TTFT
(request start to the first token's logits, nothing queued before it) and its parts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragkv.app.chat.contexts import ContextCache
from ragkv.app.chat.turn import ChatTurn, ChatTurns
from ragkv.app.generate import run_alone
from ragkv.app.rag import QueryConfig
from ragkv.app.runtime import Runtime
from ragkv.bench.datasets import Example
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import FusionConfig, FusionInput, LoadedChunk, build_strategy

TENANT = "bench"
NEW_CHUNK_TOKENS = 120


@dataclass(frozen=True)
class ConversationCase:
    context_tokens: int
    """Target size of turn 1's document."""
    document: str
    question: str
    new_texts: list[str]
    """One short document per follow-up (each a single new chunk)."""
    follow_ups: list[str]


def build_cases(
    examples: list[Example], sizes: list[int], follow_ups: int, tokenize: Callable[[str], list[int]]
) -> list[ConversationCase]:
    """Turn 1's document: passages of the first example(s) until `size` tokens; the new
    chunks: the first NEW_CHUNK_TOKENS tokens' worth of words of later passages."""
    passages = [passage for example in examples for passage in example.passages]
    cases = []
    for size in sizes:
        document, tokens, used = [], 0, 0
        while tokens < size and used < len(passages):
            document.append(passages[used])
            tokens += len(tokenize(passages[used]))
            used += 1
        if tokens < size:
            raise ValueError(f"the dataset's passages hold {tokens} tokens, fewer than {size}")
        new_texts = []
        for passage in passages[used:]:
            words = passage.split()
            while len(tokenize(" ".join(words))) > NEW_CHUNK_TOKENS:
                words = words[: int(len(words) * 0.9)]
            new_texts.append(" ".join(words))
            if len(new_texts) == follow_ups:
                break
        questions = [f"And what does the new passage say about {text.split()[0]}?" for text in new_texts]
        cases.append(ConversationCase(size, "".join(document), examples[0].question, new_texts, questions))
    return cases


def _turn(
    runtime: Runtime,
    turns: ChatTurns,
    messages: list[dict],
    doc_id: str,
    top_k: int,
    fusion: FusionConfig,
    max_new_tokens: int,
):
    config = QueryConfig(
        top_k=top_k, doc_ids=(doc_id,), fusion=fusion, generation=GenerationConfig(max_new_tokens=max_new_tokens)
    )
    return run_alone(runtime.engine, turns.request(ChatTurn(TENANT, messages, None, True, config)))


def run_conversation_bench(
    runtime: Runtime,
    cases: list[ConversationCase],
    *,
    fusion: FusionConfig | None = None,
    max_new_tokens: int = 8,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    fusion = fusion or FusionConfig()
    results = {"strategy": fusion.strategy, "max_new_tokens": max_new_tokens, "sizes": {}}
    for case in cases:
        turns = ChatTurns(runtime.rag, ContextCache(1 << 34, 1 << 34, 3600))
        document = runtime.ingestor.ingest_text(case.document, f"context-{case.context_tokens}", tenant=TENANT)
        messages = [{"role": "user", "content": case.question}]
        first = _turn(runtime, turns, messages, document.doc_id, 64, fusion, max_new_tokens)
        messages.append({"role": "assistant", "content": first.text})
        rows = []
        for number, (text, question) in enumerate(zip(case.new_texts, case.follow_ups), start=1):
            new = runtime.ingestor.ingest_text(text, f"new-{case.context_tokens}-{number}", tenant=TENANT)
            completion = _turn(
                runtime,
                turns,
                [*messages, {"role": "user", "content": question}],
                new.doc_id,
                1,
                fusion,
                max_new_tokens,
            )
            timings = completion.timings
            row = {
                "ttft_s": timings.ttft,
                "queue_s": timings.queue,
                "retrieve_s": timings.retrieve or 0.0,
                "load_s": timings.load or 0.0,
                "prefill_s": timings.prefill or 0.0,
                "fuse_s": timings.fuse or 0.0,
                "prompt_tokens": completion.usage.prompt_tokens,
                "cached_tokens": completion.usage.cached_tokens,
                "new_chunks": completion.info.new_chunks,
                "context_tokens": completion.info.context_tokens,
            }
            rows.append(row)
            progress(
                f"{case.context_tokens} tokens, follow-up {number}: TTFT {row['ttft_s']:.3f} s "
                f"(fuse {row['fuse_s']:.3f}, prefill {row['prefill_s']:.3f}), {row['prompt_tokens']} prompt tokens, "
                f"{row['cached_tokens']} cached, {row['new_chunks']} new chunk(s)"
            )
        results["sizes"][str(case.context_tokens)] = {
            "ttft_median_s": statistics.median(row["ttft_s"] for row in rows),
            "fuse_median_s": statistics.median(row["fuse_s"] for row in rows),
            "prompt_tokens": statistics.fmean(row["prompt_tokens"] for row in rows),
            "follow_ups": rows,
        }
    return results


def run_fuse_stage_bench(
    engine,
    sizes: list[int],
    *,
    strategy: str = "probe",
    question_tokens: int = 24,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """The fuse stage alone, copy against in place: a cached conversation of `size` rows
    (random K/V: the cost does not depend on the values), one new NEW_CHUNK_TOKENS-token
    chunk and a question. Medians of `repeats`, the two variants interleaved."""
    fusion = build_strategy(strategy)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    chunk_ids = torch.randint(0, vocab, (NEW_CHUNK_TOKENS,), generator=generator).tolist()
    keys, values = engine.model.chunk_kv(torch.tensor(chunk_ids), engine.chunk_prefix_cache())
    chunk = LoadedChunk(chunk_ids, keys, values)
    question = torch.randint(0, vocab, (question_tokens,), generator=generator).tolist()
    results = {"strategy": strategy, "sizes": {}}
    for size in sizes:
        prefix_ids = torch.randint(0, vocab, (size,), generator=generator).tolist()
        fusion_input = FusionInput(prefix_ids, [chunk], question, len(engine.chunk_prefix_ids))
        times: dict[str, list[float]] = {"copy": [], "in_place": []}
        for _ in range(repeats):
            for variant in ("copy", "in_place"):
                prefix = engine.model.new_cache(size + 512)
                prefix.keys.normal_(generator=generator)
                prefix.values.normal_(generator=generator)
                prefix.length = prefix.next_position = size
                started = time.perf_counter()
                fusion.fuse(engine.model, fusion_input, prefix, 16, in_place=variant == "in_place")
                times[variant].append(time.perf_counter() - started)
        row = {variant: statistics.median(values) for variant, values in times.items()}
        results["sizes"][str(size)] = {**row, "all": times}
        progress(f"{size} rows: fuse copy {row['copy']:.3f} s, in place {row['in_place']:.3f} s")
    return results
