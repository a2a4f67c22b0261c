"""`ragkv bench decode` on a tiny model: every figure present, the reference agrees with itself."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from ragkv.bench.decode_bench import OPTIONS, format_table, run_decode_bench
from ragkv.engine.kv_cache import window_slack
from ragkv.engine.model import CausalLM
from ragkv.fusion.fidelity import next_token_kl


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_bench_reports_speed_batch_and_quality(folder):
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    result = run_decode_bench(
        lambda numerics: CausalLM.load(folder, numerics=numerics),
        prompts,
        options=["float32", "int8"],
        contexts=[16, 32],
        batches=[1, 2],
        batch_context=8,
        steps=2,
        max_new_tokens=3,
    )
    assert [(row.option, row.context) for row in result.speed] == [
        ("float32", 16),
        ("float32", 32),
        ("int8", 16),
        ("int8", 32),
    ]
    assert all(row.ms_per_token > 0 and row.bytes_per_step > 0 for row in result.speed)
    int8_bytes = {row.context: row.bytes_per_step for row in result.speed if row.option == "int8"}
    float_bytes = {row.context: row.bytes_per_step for row in result.speed if row.option == "float32"}
    assert int8_bytes[16] < float_bytes[16]
    assert {(row.option, row.batch) for row in result.batch} == {
        ("float32", 1),
        ("float32", 2),
        ("int8", 1),
        ("int8", 2),
    }
    reference = next(row for row in result.quality if row.option == "float32")
    assert reference.first_token_kl_max == pytest.approx(0.0, abs=1e-6) and reference.answer_agreement == 1.0
    json.dumps(result.to_json())


def test_bench_reports_the_kv_a_sliding_window_model_holds(tmp_path):
    """Tiny Gemma 3: 3 of 4 layers windowed (8 rows), so past the window a token costs a
    quarter of its bytes, and at 64 rows the windowed layers hold at most 7 + slack rows."""
    folder = make_tiny_model("gemma3", tmp_path / "gemma3")
    result = run_decode_bench(
        lambda numerics: CausalLM.load(folder, numerics=numerics),
        [],
        options=["float32"],
        contexts=[64],
        batches=[],
        batch_context=8,
        steps=2,
        max_new_tokens=1,
    )
    (row,) = result.window
    row_bytes = 2 * 1 * 16 * 4  # K and V of one KV head of 16 float32 values
    assert row.kv_bytes_per_token_full_layers == 4 * row_bytes and row.kv_bytes_per_token_trimmed == row_bytes
    rows = 64 + 2 + 3  # the context, the timed and the warm-up steps
    assert row.kv_bytes_held_at_context_untrimmed == 4 * rows * row_bytes
    assert row.kv_bytes_held_at_context <= (rows + 3 * (7 + window_slack(8))) * row_bytes
    assert row.ms_per_token > 0 and "held untrimmed" in format_table(result)


def test_unknown_option_is_refused(folder):
    with pytest.raises(ValueError, match="unknown options"):
        run_decode_bench(
            lambda n: None, [], options=["int3"], contexts=[], batches=[], batch_context=8, steps=1, max_new_tokens=1
        )


def test_kl_is_zero_for_equal_logits_and_positive_otherwise():
    import torch

    logits = torch.tensor([1.0, 2.0, 3.0])
    assert next_token_kl(logits, logits) == pytest.approx(0.0, abs=1e-7)
    assert next_token_kl(logits, logits.flip(0)) > 0.1
    assert set(OPTIONS) >= {"float32", "int8", "bfloat16"}


def test_cli_writes_json(folder, tmp_path, capsys):
    from ragkv.cli.main import main

    out = tmp_path / "decode.json"
    code = main(
        [
            "bench",
            "decode",
            "--model",
            str(folder),
            "--options",
            "float32",
            "int8",
            "--contexts",
            "16",
            "--batches",
            "1",
            "2",
            "--batch-context",
            "8",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "ms@16" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert {row["option"] for row in figures["speed"]} == {"float32", "int8"} and len(figures["batch"]) == 4
