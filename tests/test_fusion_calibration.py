"""`ragkv calibrate fusion` on a tiny model: the smallest ratio of the grid within the KL
target is stored under the model fingerprint, requests that name no ratio use it, and the
server reports it on /v1/models (a real `ragkv serve`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tiny_models import make_tiny_model

from ragkv.api.launcher import ServerProcess
from ragkv.app.fusion_calibration import (
    FusionCalibrationConfig,
    calibrate_fusion,
    grid,
    load_calibration,
    save_calibration,
    stored_fusion_settings,
)
from ragkv.app.runtime import Runtime, RuntimeConfig
from ragkv.cli.main import main
from ragkv.engine import Engine, EngineConfig
from ragkv.fusion import CalibratedFusion, FusionConfig

pytestmark = pytest.mark.model  # the packaged SmolLM2 tokenizer or model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
FLOAT32 = ["--weights", "float32", "--prefill-weights", "float32", "--kv-cache-dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-calibration"), tokenizer=True)
    patch = pytest.MonkeyPatch()
    patch.setenv("RAGKV_CACHE", str(tmp_path_factory.mktemp("ragkv-cache")))
    yield folder
    patch.undo()


def _engine_config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), weights="float32", prefill_weights="float32", kv_cache_dtype="float32")


def test_calibration_picks_the_smallest_ratio_within_the_target(tiny):
    engine = Engine(_engine_config(tiny))
    texts = [path.read_text() for path in sorted(CORPUS.iterdir())]
    config = FusionCalibrationConfig(
        ratios=(0.0, 0.5, 1.0),
        refresh_ratios=(0.0,),
        samples=2,
        chunks_per_sample=3,
        chunk_tokens=64,
        max_new_tokens=4,
        target_kl=1.0,
    )
    figures = calibrate_fusion(engine, texts, config).figures
    # ratio 1 recomputes everything: the full prefill up to float rounding
    assert figures["1"]["first_token_kl"] < 1e-6 and figures["1"]["teacher_forced_agreement"] == 1.0
    worst = {ratio: max(f["first_token_kl"], f["teacher_forced_kl"]) for ratio, f in figures.items()}
    assert worst["0"] > 1e-4
    # the smallest ratio within the target: 0 when the target admits every ratio; 1 when
    # only the full recompute is within it
    between = (worst["1"] + min(worst["0"], worst["0.5"])) / 2
    assert between > worst["1"]
    for target, known in ((worst["0"] * 1.01 + max(worst.values()), 0.0), (between, 1.0)):
        chosen = calibrate_fusion(engine, texts, FusionCalibrationConfig(**{**config.__dict__, "target_kl": target}))
        assert chosen.ratio == known and chosen.figures == figures


def test_calibrated_ratio_is_stored_used_and_reported(tiny, tmp_path, capsys):
    home = tmp_path / "home"
    common = ["--data-dir", str(home), "--model", str(tiny), *FLOAT32]
    assert (
        main(
            ["calibrate", "fusion", str(CORPUS), "--ratios", "0", "1", "--target-kl", "1e-6", "--samples", "2", *common]
        )
        == 0
    )
    assert "ratio 1 meets" in capsys.readouterr().out
    with Runtime(RuntimeConfig(data_dir=home, engine=_engine_config(tiny))) as runtime:
        stored = load_calibration(runtime.env, runtime.engine.fingerprint, "probe")
        assert stored is not None and stored.ratio == 1.0
        assert runtime.calibrated.fusion == {"probe": CalibratedFusion(1.0, 0.0)}
        assert FusionConfig().build(runtime.calibrated.fusion).ratio == 1.0
        # a request's own ratio, or a spec naming one, wins over the calibrated one
        assert FusionConfig(ratio=0.2).build(runtime.calibrated.fusion).ratio == 0.2
        assert FusionConfig("probe:ratio=0.3").build(runtime.calibrated.fusion).ratio == 0.3
    # a grid where no ratio meets the target stores nothing and says so
    assert (
        main(
            [
                "calibrate",
                "fusion",
                str(CORPUS),
                "--ratios",
                "0",
                "--target-kl",
                "1e-9",
                "--samples",
                "1",
                "--data-dir",
                str(tmp_path / "other"),
                "--model",
                str(tiny),
                *FLOAT32,
            ]
        )
        == 1
    )
    assert "nothing stored" in capsys.readouterr().err

    server = ServerProcess(["--data-dir", str(home), "--model", str(tiny), *FLOAT32], log_path=tmp_path / "serve.log")
    server.start()
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        fusion = models[0]["fusion"]
        assert fusion == {"strategy": "probe", "ratio": 1.0, "calibrated": True, "refresh_ratio": 0.0}
        assert "uses the calibrated ratio 1.00, answer refresh 0.00" in server.log()
    finally:
        server.stop()


def test_calibration_reads_chunks_as_ingestion_stores_them_in_context(tiny):
    engine = Engine(_engine_config(tiny))
    texts = [path.read_text() for path in sorted(CORPUS.iterdir())]
    config = FusionCalibrationConfig(
        ratios=(0.0, 1.0), samples=2, chunks_per_sample=3, chunk_tokens=64, max_new_tokens=4
    )
    plain = calibrate_fusion(engine, texts, config).figures
    in_context = FusionCalibrationConfig(**{**config.__dict__, "context_chunks": 1})
    placed = calibrate_fusion(engine, texts, in_context).figures
    # the full recompute does not read stored rows; with none, rows computed after their
    # preceding chunk (the sample's chunks are consecutive) sit closer to the full prefill
    assert placed["1"]["first_token_kl"] < 1e-6 and plain["1"]["first_token_kl"] < 1e-6
    assert placed["0"]["first_token_kl"] != plain["0"]["first_token_kl"]
    assert placed["0"]["teacher_forced_kl"] < plain["0"]["teacher_forced_kl"]
    with pytest.raises(ValueError, match="context_chunks"):
        FusionCalibrationConfig(context_chunks=-1)


def test_the_grid_runs_cheapest_first_and_refreshes_only_the_probe():
    labels = [point.label for point in grid(FusionCalibrationConfig(ratios=(0.1, 0.2, 1.0), refresh_ratios=(0.0, 0.1)))]
    # equal rows recomputed: the plain ratio before the refresh; nothing past every row
    assert labels == ["0.1", "0.2", "0.1+refresh 0.1", "0.2+refresh 0.1", "1"]
    assert [point.label for point in grid(FusionCalibrationConfig(strategy="a3", ratios=(0.1,)))] == ["0.1"]
    with pytest.raises(ValueError, match="no answer refresh"):
        FusionCalibrationConfig(strategy="a3", refresh_ratios=(0.1,))
    with pytest.raises(ValueError, match="refresh_ratios"):
        FusionCalibrationConfig(refresh_ratios=(1.5,))


def test_an_answer_refresh_is_chosen_stored_and_applied_when_only_it_meets_the_target(tiny, tmp_path):
    engine = Engine(_engine_config(tiny))
    texts = [path.read_text() for path in sorted(CORPUS.iterdir())]
    config = FusionCalibrationConfig(
        # the rerun: the probe's own rows (min_rows of them) run again after the refreshed ones
        strategy="probe:refresh_rerun=true",
        ratios=(0.0,),
        refresh_ratios=(0.0, 1.0),
        samples=2,
        chunks_per_sample=3,
        chunk_tokens=64,
        max_new_tokens=4,
        target_kl=1e-6,
    )
    calibration = calibrate_fusion(engine, texts, config)
    # no recompute is far from the full prefill; a refresh of every stale row is the full
    # prefill up to float rounding
    assert calibration.figures["0"]["first_token_kl"] > 1e-4
    assert calibration.figures["0+refresh 1"]["first_token_kl"] < 1e-6
    assert (calibration.ratio, calibration.refresh_ratio) == (0.0, 1.0)
    # with every point within the KL target, an agreement target decides
    agreeing = calibrate_fusion(engine, texts, FusionCalibrationConfig(**{**config.__dict__, "target_kl": 10.0}))
    assert (agreeing.ratio, agreeing.refresh_ratio) == (0.0, 0.0)
    plain_agreement = calibration.figures["0"]["teacher_forced_agreement"]
    assert calibration.figures["0+refresh 1"]["teacher_forced_agreement"] == 1.0
    if plain_agreement < 1.0:
        strict = FusionCalibrationConfig(**{**config.__dict__, "target_kl": 10.0, "min_agreement": 1.0})
        assert calibrate_fusion(engine, texts, strict).refresh_ratio == 1.0
    with pytest.raises(ValueError, match="min_agreement"):
        FusionCalibrationConfig(min_agreement=1.5)

    with Runtime(RuntimeConfig(data_dir=tmp_path, engine=_engine_config(tiny))) as runtime:
        save_calibration(runtime.env, engine.fingerprint, calibration)
        settings = stored_fusion_settings(runtime.env, runtime.engine.fingerprint)
        assert settings == {"probe": CalibratedFusion(0.0, 1.0)}
        built = FusionConfig().build(settings)
        assert (built.ratio, built.refresh_ratio) == (0.0, 1.0)
        # a request naming its own ratio, or a spec naming the refresh, keeps its own
        assert FusionConfig(ratio=0.2).build(settings).refresh_ratio == 0.0
        spec = FusionConfig("probe:refresh_ratio=0.05").build(settings)
        assert (spec.ratio, spec.refresh_ratio) == (0.0, 0.05)
