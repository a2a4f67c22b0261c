"""Question-answering sets for the benchmarks: CacheBlend-style JSON and LongBench JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Example:
    question: str
    passages: list[str]
    answers: list[str]


def load_examples(path: Path, limit: int | None = None, passages: int | None = None) -> list[Example]:
    """CacheBlend JSON: a list of {ctxs: [{title, text}], question, answers}. LongBench
    JSONL: one {input, context, answers} per line (the context becomes one passage)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    examples = []
    if raw.lstrip().startswith("["):
        for item in json.loads(raw):
            texts = [f"{ctx.get('title', '')}\n{ctx['text']}".strip() + "\n\n" for ctx in item["ctxs"]]
            examples.append(Example(item["question"], texts[:passages] if passages else texts, list(item["answers"])))
    else:
        for line in raw.splitlines():
            if line.strip():
                item = json.loads(line)
                examples.append(Example(item["input"], [item["context"]], list(item["answers"])))
    if not examples:
        raise ValueError(f"dataset {path} holds no examples")
    return examples[:limit] if limit else examples
