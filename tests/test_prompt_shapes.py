"""The prompt shapes real apps send (ragkv.bench.prompt_shapes) and `bench passages
--shapes`/`--methods` on them: every shape holds each passage's text verbatim and the
question; the finder with anchors serves a next prompt's reusable tokens in every shape."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ragkv.bench.datasets import Example
from ragkv.bench.prompt_shapes import SHAPES, Passage, split_documents
from ragkv.bench.span_methods import run_span_methods

TEXTS = [
    f"Passage {i} tells how the harbour town of Kestrel Bay {what} in the year {1800 + 13 * i}, "
    f"and why the council of the day kept records of it in the old customs house. " * 3
    for i, what in enumerate(["built its pier", "lost its ferry", "opened a school", "paved the quay", "lit a lamp"])
]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_holds_each_passage_and_the_question(name):
    passages = [Passage(text, f"title {i}", i) for i, text in enumerate(TEXTS, 1)]
    messages = SHAPES[name].messages(passages, "When was the pier built?")
    content = "\n".join(m["content"] for m in messages)
    assert all(text in content or text.replace('"', '\\"') in content for text in TEXTS)
    assert "When was the pier built?" in content
    assert {m["role"] for m in messages} <= {"system", "user"}
    with pytest.raises(ValueError):
        SHAPES[name].messages([], "q")


def test_the_splitter_cuts_overlapping_chunks_that_move_with_the_size():
    document = "\n\n".join(TEXTS)
    first, second = split_documents([document], 300, 60), split_documents([document], 240, 60)
    assert len(first) > 3 and set(first).isdisjoint(second)
    assert all(len(chunk) <= 300 for chunk in first)


def test_anchors_serve_the_reusable_tokens_of_every_shape(engine):
    examples = [
        Example(
            question=f"Question {n}?",
            passages=[TEXTS[(n + k) % 5] + f" Note {n}-{k}." for k in range(5)] * 2,
            answers=[],
        )
        for n in range(3)
    ]
    results = run_span_methods(engine.prompt, engine.tokenizer, examples, seed=0)
    assert set(results) == {*SHAPES, "splitter"}
    for shape, row in results.items():
        assert row["anchors"] >= 0.95, (shape, row)
        assert row["anchors"] >= row["spans"]


def test_an_unknown_shape_exits_with_the_known_names(tmp_path):
    data = tmp_path / "d.json"
    data.write_text('[{"question": "q?", "answers": ["a"], "ctxs": [{"title": "t", "text": "some text"}]}]')
    done = subprocess.run(
        [sys.executable, "-m", "ragkv", "bench", "passages", "--data", str(data), "--shapes", "slack"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "open_webui" in done.stderr and "Traceback" not in done.stderr
