"""Teacher-forced fidelity (ragkv.bench.teacher_forced) and `ragkv bench fusion`'s figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fusion_cases import fused_case
from tiny_models import make_tiny_model

from ragkv.app.generate import decode, forced_answer_ids
from ragkv.cli.main import main
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import Full, FullReuse
from ragkv.fusion.fidelity import TeacherForced, teacher_forced_logits

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


@pytest.fixture(scope="module")
def forced_case(engine):
    fusion_input, _ = fused_case(engine)
    full = Full().fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), 16)
    answer = forced_answer_ids(decode(engine, full.cache, full.logits, GenerationConfig(max_new_tokens=12)))
    full.cache.truncate(full.layout.length)
    return engine, fusion_input, full, answer


def test_teacher_forced_logits_are_the_greedy_decode_and_leave_the_cache(forced_case):
    engine, _, full, answer = forced_case
    length = full.cache.length
    forced = teacher_forced_logits(engine.model, full.cache, full.logits, answer)
    assert full.cache.length == length and forced.shape == (len(answer), engine.spec.vocab_size)
    # full's own greedy answer is the argmax at every position
    assert forced.argmax(-1).tolist() == answer


def test_teacher_forced_figures_are_exact_for_full_and_fall_for_full_reuse(forced_case):
    engine, fusion_input, full, answer = forced_case
    reference = teacher_forced_logits(engine.model, full.cache, full.logits, answer)
    again = Full().fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), 16)
    same = TeacherForced.compare(reference, teacher_forced_logits(engine.model, again.cache, again.logits, answer))
    assert (same.agreement, same.kl, same.kl_max, same.positions) == (1.0, 0.0, 0.0, len(answer))
    reused = FullReuse().fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), 16)
    reused_logits = teacher_forced_logits(engine.model, reused.cache, reused.logits, answer)
    worse = TeacherForced.compare(reference, reused_logits)
    # the distributions move away; the agreement is the share of positions whose argmax holds
    held = (reference.argmax(-1) == reused_logits.argmax(-1)).double().mean()
    assert worse.kl > 1e-3 and worse.positions == len(answer) and worse.agreement == pytest.approx(float(held))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-fidelity"), tokenizer=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("RAGKV_CACHE", str(tmp_path_factory.mktemp("ragkv-cache")))
    yield folder, tmp_path_factory.mktemp("ragkv-home")
    patch.undo()


def _qa_file(tmp_path, questions) -> Path:
    """A CacheBlend-style dataset: each question over the same three corpus passages."""
    passages = [
        {"title": f"P{i}", "text": CORPUS.joinpath(name).read_text()[:400]}
        for i, name in enumerate(sorted(p.name for p in CORPUS.iterdir()))
    ][:3]
    data = tmp_path / "qa.json"
    data.write_text(json.dumps([{"ctxs": passages, "question": q, "answers": ["x"]} for q in questions]))
    return data


@pytest.mark.model
def test_bench_fusion_reports_teacher_forced_figures_with_spread(tiny, tmp_path):
    folder, home = tiny
    data = _qa_file(tmp_path, ("When was the light automated?", "Who grows apples?", "How high is the observatory?"))
    out = tmp_path / "fusion.json"
    code = main(
        [
            "bench",
            "fusion",
            "--data",
            str(data),
            "--examples",
            "1:3",
            "--strategies",
            "full_reuse",
            "probe:ratio=0.5",
            "--max-new-tokens",
            "6",
            "--weight-formats",
            "int8",
            "--json",
            str(out),
            "--data-dir",
            str(home),
            "--model",
            str(folder),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert results["examples"] == 2 and results["example_range"] == [1, 3]
    full = results["strategies"]["full"]
    assert full["teacher_forced_agreement"] == 1.0 and full["teacher_forced_kl"] == 0.0
    reuse = results["strategies"]["full_reuse"]
    assert reuse["teacher_forced_kl"] > 0.0
    spread = reuse["teacher_forced_kl_spread"]
    rows = [row["teacher_forced_kl"] for row in results["per_example"]["full_reuse"]]
    assert spread["min"] == min(rows) and spread["max"] == max(rows)
    assert spread["min"] <= spread["p25"] <= spread["median"] <= spread["p75"] <= spread["max"]
    int8 = results["weights"]["weights=int8"]
    assert len(int8["per_example"]) == 2
    for figure in ("teacher_forced_kl", "teacher_forced_agreement"):  # the mean of the examples'
        assert int8[figure] == pytest.approx(sum(row[figure] for row in int8["per_example"]) / 2)
    assert int8["teacher_forced_kl"] > 0.0  # int8 weights move the distribution off the float32 reference


def test_bench_fusion_refuses_a_bad_example_range(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "fusion", "--data", str(tmp_path / "x.json"), "--examples", "5:2"])
    assert exit_info.value.code == 2 and "START < END" in capsys.readouterr().err


@pytest.mark.model
def test_bench_conversation_fidelity_finds_the_whole_chunk_recompute_exact(tiny, tmp_path):
    """A follow-up's new chunk recomputed whole, reading every conversation row, is the
    exact answer; reusing it as stored is not."""
    folder, home = tiny
    data = _qa_file(tmp_path, ("Who?", "What?"))
    out = tmp_path / "conversation.json"
    numerics = ["--weights", "float32", "--prefill-weights", "float32", "--kv-cache-dtype", "float32"]
    args = ["bench", "conversation", "--data", str(data), "--sizes", "150", "--examples", "0:1"]
    args += ["--fidelity", "probe:prefix_window=0", "full_reuse", "--max-new-tokens", "4", "--json", str(out)]
    assert main([*args, *numerics, "--data-dir", str(home), "--model", str(folder)]) == 0
    results = json.loads(out.read_text())["sizes"]["150"]
    whole, reuse = results["strategies"]["probe:prefix_window=0"], results["strategies"]["full_reuse"]
    assert whole["examples"][0]["recomputed_tokens"] > 0 and reuse["examples"][0]["recomputed_tokens"] == 0
    assert whole["first_token_kl"] < 1e-6 and whole["teacher_forced_agreement"] == 1.0
    assert reuse["first_token_kl"] > 1e-4
