"""`ragkv calibrate fusion`: the cheapest fusion settings that keep the answer within a KL
target of the full prefill, for this model on the user's own documents.

Samples: consecutive chunks of the documents as the retrieved context, with a question
per sample (given, or a sentence of one of its chunks, so the question reads the context
the way a user's would). Each point of the grid (a recompute ratio, and for the probe an
answer-refresh share) fuses every sample, and its first-token KL and teacher-forced KL and
agreement along the full prefill's greedy answer are measured (ragkv.fusion.fidelity: the
same decode step the server runs). The cheapest point (fewest rows recomputed, a refresh
counted as rows, then no refresh before one) whose means meet the targets is stored under
the model fingerprint (sub-database ``fusion_calibration`` of the LMDB environment, like
the A2ATS codebook), and the server and `ragkv ask` use it when a request names no ratio.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragkv.app.generate import decode, forced_answer_ids
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import CalibratedFusion, FusionInput, FusionStrategy, LoadedChunk, build_strategy
from ragkv.fusion.config import has_option
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits
from ragkv.fusion.registry import DEFAULT_STRATEGY
from ragkv.ingest.chunk_context import stored_in_context
from ragkv.ingest.chunker import chunk_document
from ragkv.store.lmdb_env import LMDBEnvironment

log = logging.getLogger("ragkv.calibration")

CALIBRATION_DB = "fusion_calibration"
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1.0)
DEFAULT_REFRESH_RATIOS = (0.0, 0.1)
_SENTENCE = re.compile(r"[^.!?\n]{24,200}[.!?]")


@dataclass(frozen=True)
class FusionCalibrationConfig:
    strategy: str = DEFAULT_STRATEGY
    """Strategy calibrated (one with a ratio): name or spec without a ratio."""
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    """Ratios tried, smallest first."""
    refresh_ratios: tuple[float, ...] | None = None
    """Answer-refresh shares tried with each ratio (the probe's `refresh_ratio`; 0 = none).
    Points whose ratio and refresh add up to more than 1 are skipped. None =
    DEFAULT_REFRESH_RATIOS for a strategy with an answer refresh, else (0,)."""
    target_kl: float = 0.05
    """Mean first-token KL and mean teacher-forced KL (nats) a point must both meet."""
    min_agreement: float = 0.0
    """Mean teacher-forced agreement (share of the full prefill's answer tokens the fused
    cache predicts greedily) a point must meet as well (0 = KL alone)."""
    samples: int = 8
    """Questions measured."""
    chunks_per_sample: int = 5
    """Consecutive chunks fused per question (the retrieved context)."""
    chunk_tokens: int = 128
    max_new_tokens: int = 16
    """Length of the full prefill's answer the teacher-forced KL runs along."""
    context_chunks: int = 0
    """Chunks of its document placed before each chunk when its K/V is computed, as ingestion's
    --context-neighbours stores it (`ragkv calibrate fusion` passes the server's setting).
    Calibration has no retrieval index: the preceding chunks stand in for the nearest ones."""
    seed: int = 0

    def __post_init__(self) -> None:
        strategy = build_strategy(self.strategy)
        if not has_option(strategy, "ratio"):
            raise ValueError(f"{strategy.name} has no recompute ratio to calibrate")
        if not self.ratios or any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise ValueError("ratios must be a non-empty list of values in [0, 1]")
        refreshes = self.refresh_ratios
        if refreshes is not None and (not refreshes or any(not 0.0 <= r <= 1.0 for r in refreshes)):
            raise ValueError("refresh_ratios must be a non-empty list of values in [0, 1]")
        if any(refreshes or ()) and not has_option(strategy, "refresh_ratio"):
            raise ValueError(f"{strategy.name} has no answer refresh: give refresh ratios 0 only")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError("min_agreement must be in [0, 1]")
        if not self.target_kl > 0.0:
            raise ValueError("target_kl must be > 0")
        if self.context_chunks < 0:
            raise ValueError("context_chunks must be >= 0")
        if self.samples < 1 or self.chunks_per_sample < 1 or self.chunk_tokens < 16 or self.max_new_tokens < 1:
            raise ValueError("samples, chunks_per_sample and max_new_tokens must be >= 1, chunk_tokens >= 16")


@dataclass(frozen=True, order=True)
class CalibrationPoint:
    """One setting of the grid; ordered cheapest first."""

    cost: float
    """Share of the document rows recomputed: ratio + refresh_ratio."""
    refresh_ratio: float
    ratio: float

    @classmethod
    def of(cls, ratio: float, refresh_ratio: float) -> CalibrationPoint:
        return cls(round(ratio + refresh_ratio, 6), refresh_ratio, ratio)

    @property
    def label(self) -> str:
        return f"{self.ratio:g}" if not self.refresh_ratio else f"{self.ratio:g}+refresh {self.refresh_ratio:g}"

    def strategy(self, strategy: FusionStrategy) -> FusionStrategy:
        if not self.refresh_ratio:
            return dataclasses.replace(strategy, ratio=self.ratio)
        return dataclasses.replace(strategy, ratio=self.ratio, refresh_ratio=self.refresh_ratio)


def grid(config: FusionCalibrationConfig) -> list[CalibrationPoint]:
    """The points measured, cheapest first."""
    refreshes = config.refresh_ratios
    if refreshes is None:
        refreshes = DEFAULT_REFRESH_RATIOS if has_option(build_strategy(config.strategy), "refresh_ratio") else (0.0,)
    points = {
        CalibrationPoint.of(ratio, refresh)
        for ratio in config.ratios
        for refresh in refreshes
        if not refresh or ratio + refresh <= 1.0
    }
    return sorted(points)


@dataclass(frozen=True)
class FusionCalibration:
    """What is stored: the settings chosen and the figures they were chosen from."""

    strategy: str
    ratio: float | None
    """None when no point of the grid met the targets."""
    target_kl: float
    samples: int
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per point (its label: "0.1", or "0.1+refresh 0.1"): mean first_token_kl,
    teacher_forced_kl, teacher_forced_agreement."""
    refresh_ratio: float = 0.0
    """The answer refresh chosen with the ratio (0 = none)."""
    min_agreement: float = 0.0

    @property
    def settings(self) -> CalibratedFusion | None:
        return None if self.ratio is None else CalibratedFusion(self.ratio, self.refresh_ratio)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> FusionCalibration:
        return cls(**json.loads(raw))


def _key(fingerprint: str, strategy: str) -> bytes:
    return f"{strategy}/{fingerprint}".encode()


def save_calibration(env: LMDBEnvironment, fingerprint: str, calibration: FusionCalibration) -> None:
    db = env.db(CALIBRATION_DB)
    env.write(lambda txn: txn.put(_key(fingerprint, calibration.strategy), calibration.to_json(), db=db))


def load_calibration(env: LMDBEnvironment, fingerprint: str, strategy: str) -> FusionCalibration | None:
    db = env.db(CALIBRATION_DB)
    with env.read() as txn:
        raw = txn.get(_key(fingerprint, strategy), db=db)
    return None if raw is None else FusionCalibration.from_json(bytes(raw))


def stored_fusion_settings(env: LMDBEnvironment, fingerprint: str) -> dict[str, CalibratedFusion]:
    """The calibrated settings of every strategy calibrated for the model with `fingerprint`
    (requests that name no ratio use them), each logged."""
    from ragkv.fusion.registry import STRATEGY_NAMES

    chosen = {}
    for name in STRATEGY_NAMES:
        calibration = load_calibration(env, fingerprint, name)
        if calibration is not None and calibration.settings is not None:
            chosen[name] = calibration.settings
            log.info(
                "fusion: %s uses the calibrated ratio %.2f, answer refresh %.2f (first-token and "
                "teacher-forced KL <= %.3f on %d sampled questions)",
                name,
                calibration.ratio,
                calibration.refresh_ratio,
                calibration.target_kl,
                calibration.samples,
            )
    return chosen


def sample_questions(texts: list[str], count: int, rng: random.Random) -> list[str]:
    """Questions made of the documents' own sentences."""
    sentences = [match.group(0).strip() for text in texts for match in _SENTENCE.finditer(text)]
    if not sentences:
        raise ValueError("the documents hold no sentence to ask about: give --questions")
    return [f"What does the text say about this: {rng.choice(sentences)}" for _ in range(count)]


class _SampledChunks:
    """The documents' chunks, each stored as ingestion stores it (after its preceding
    chunks when `context_chunks` is set), computed once on first use."""

    def __init__(self, engine, texts: list[str], config: FusionCalibrationConfig):
        documents = [
            [chunk.token_ids for chunk in chunk_document(engine.tokenizer, text, config.chunk_tokens)] for text in texts
        ]
        self.engine, self.context_chunks = engine, config.context_chunks
        self.pool = [ids for chunks in documents for ids in chunks]
        # each pool chunk's index in its document: its preceding chunks are its context
        self.position = [index for chunks in documents for index in range(len(chunks))]
        if not self.pool:
            raise ValueError("the documents are empty")
        self._plain: dict[int, dict] = {}
        self._loaded: dict[int, LoadedChunk] = {}

    def _encoded(self, index: int) -> dict:
        if index not in self._plain:
            self._plain[index] = self.engine.encode_chunk(self.pool[index])
        return self._plain[index]

    def loaded(self, index: int) -> LoadedChunk:
        if index not in self._loaded:
            engine = self.engine
            before = range(index - min(self.context_chunks, self.position[index]), index)
            encoded = [self._encoded(i) for i in before]
            tensors = stored_in_context(engine, self.pool[index], encoded) if before else self._encoded(index)
            self._loaded[index] = LoadedChunk(self.pool[index], *engine.kv_format.unpack(tensors))
        return self._loaded[index]

    def sample(self, rng: random.Random, count: int) -> list[LoadedChunk]:
        """`count` neighbouring chunks from a random start."""
        start = rng.randrange(max(1, len(self.pool) - count + 1))
        return [self.loaded(i) for i in range(start, min(len(self.pool), start + count))]


def _measure(
    engine, fusion_input: FusionInput, strategy, points: list[CalibrationPoint], max_new_tokens: int
) -> list[tuple[float, TeacherForced]]:
    """Per point, (first-token KL, teacher-forced comparison) of the fused prompt against the
    full prefill, on the full prefill's own greedy answer."""
    model, prefix_cache = engine.model, engine.chunk_prefix_cache()
    full = build_strategy("full").fuse(model, fusion_input, prefix_cache, max_new_tokens)
    answer = forced_answer_ids(decode(engine, full.cache, full.logits, GenerationConfig(max_new_tokens=max_new_tokens)))
    full.cache.truncate(full.layout.length)
    reference = teacher_forced_logits(model, full.cache, full.logits, answer)
    rows = []
    for point in points:
        fused = point.strategy(strategy).fuse(model, fusion_input, prefix_cache, max_new_tokens)
        forced = TeacherForced.compare(reference, teacher_forced_logits(model, fused.cache, fused.logits, answer))
        rows.append((next_token_kl(full.logits, fused.logits), forced))
    return rows


def _choose(
    per_point: dict[CalibrationPoint, list[tuple[float, TeacherForced]]], config: FusionCalibrationConfig
) -> tuple[dict[str, dict], CalibrationPoint | None]:
    """Each point's mean figures, and the first point (in grid order) within the target KL
    and agreement; None when none is."""
    figures, chosen = {}, None
    for point, rows in per_point.items():
        figure = {
            "first_token_kl": float(torch.tensor([kl for kl, _ in rows]).mean()),
            "teacher_forced_kl": float(torch.tensor([f.kl for _, f in rows]).mean()),
            "teacher_forced_agreement": float(torch.tensor([f.agreement for _, f in rows]).mean()),
        }
        figures[point.label] = figure
        within = max(figure["first_token_kl"], figure["teacher_forced_kl"]) <= config.target_kl
        if chosen is None and within and figure["teacher_forced_agreement"] >= config.min_agreement:
            chosen = point
    return figures, chosen


def calibrate_fusion(
    engine,
    texts: list[str],
    config: FusionCalibrationConfig,
    questions: list[str] | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> FusionCalibration:
    rng = random.Random(config.seed)
    chunks = _SampledChunks(engine, texts, config)
    questions = list(questions or sample_questions(texts, config.samples, rng))[: config.samples]
    strategy = build_strategy(config.strategy)
    points = grid(config)
    per_point: dict[CalibrationPoint, list[tuple[float, TeacherForced]]] = {point: [] for point in points}
    for number, question in enumerate(questions, start=1):
        progress(f"question {number}/{len(questions)}")
        sampled = chunks.sample(rng, config.chunks_per_sample)
        segments = engine.prompt.rag_segments(question)
        fusion_input = FusionInput(
            segments.prefix_ids,
            sampled,
            segments.question_ids,
            len(engine.chunk_prefix_ids),
            segments.question_text_span,
        )
        for point, row in zip(points, _measure(engine, fusion_input, strategy, points, config.max_new_tokens)):
            per_point[point].append(row)
    figures, chosen = _choose(per_point, config)
    return FusionCalibration(
        strategy.name,
        None if chosen is None else chosen.ratio,
        config.target_kl,
        len(questions),
        figures,
        0.0 if chosen is None else chosen.refresh_ratio,
        config.min_agreement,
    )
