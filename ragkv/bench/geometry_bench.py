"""Fused vs full prefill and the decode step at a real model's geometry, random weights.

No checkpoint of a large model can be downloaded onto the machines that run this (an H100
box has no network), and speed does not depend on what the weights say: a model of the
named geometry is made on the device with random weights (bfloat16 by default), a prompt
of stored chunks is fused with the product's default strategy and prefilled whole, and
decode steps run after the full prefill. The decode step is set beside the floor that
memory bandwidth puts under it: every weight and every cached K/V row read once per step,
at the bandwidth a device-to-device copy measures on the same device.

Chunks start as the store hands them to a query: pre-RoPE K/V in the store's format (int4
codes by default) in host memory, so the fused time includes moving them to the device.
The first-token KL between the fused and the full prefill is reported as a sanity check
only: random weights make it no measure of answer quality (`ragkv bench fusion` is).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import torch

from ragkv.bench.kernel_bench import GEOMETRIES, Geometry
from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
from ragkv.engine.linear import Linear
from ragkv.engine.model import CausalLM
from ragkv.engine.model_spec import ModelSpec, RopeSpec
from ragkv.engine.numerics import Numerics
from ragkv.engine.weights import LayerWeights, ModelWeights
from ragkv.fusion import DEFAULT_STRATEGY, FusionInput, LoadedChunk, build_strategy
from ragkv.fusion.fidelity import next_token_kl

T = TypeVar("T")
CHUNK_TOKENS = 512
PREFIX_TOKENS = 32
QUESTION_TOKENS = 48


ROPE_THETA = {"llama3-8b": 500000.0}
"""RoPE bases of the named geometries (positions only rotate: speed does not depend on it)."""


def model_spec(geometry: Geometry, max_positions: int) -> ModelSpec:
    """A Llama-family spec of `geometry` (no biases, no q/k norms, untied LM head)."""
    theta = ROPE_THETA.get(geometry.name, 10000.0)
    return ModelSpec(
        family="llama",
        num_layers=geometry.layers,
        hidden_size=geometry.hidden,
        intermediate_size=geometry.intermediate,
        num_heads=geometry.q_heads,
        num_kv_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
        vocab_size=geometry.vocab,
        rms_norm_eps=1e-5,
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        hidden_act="silu",
        rope=RopeSpec("default", theta, geometry.head_dim, max_positions),
        bos_token_id=None,
        eos_token_ids=(),
    )


@dataclass(frozen=True)
class GeometryBenchConfig:
    geometry: Geometry = GEOMETRIES["llama3-8b"]
    device: str = "cuda"
    dtype: str = "bfloat16"
    lengths: tuple[int, ...] = (6144, 32768)
    strategy: str = DEFAULT_STRATEGY
    kv_storage: str = "int4"
    """Format the chunks are held in before the query, as the store keeps them."""
    repeats: int = 3
    decode_steps: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_storage not in KV_STORAGE_FORMATS:
            raise ValueError(f"kv_storage must be one of {sorted(KV_STORAGE_FORMATS)}, got {self.kv_storage!r}")
        if self.repeats < 1 or self.decode_steps < 1:
            raise ValueError("repeats and decode_steps must be >= 1")
        too_short = [n for n in self.lengths if n < PREFIX_TOKENS + CHUNK_TOKENS + QUESTION_TOKENS]
        if too_short:
            shortest = PREFIX_TOKENS + CHUNK_TOKENS + QUESTION_TOKENS
            raise ValueError(f"lengths {too_short} hold no chunk; each needs >= {shortest}")
        torch.device(self.device)  # a bad name raises here


@dataclass(frozen=True)
class LengthResult:
    prompt_tokens: int
    chunks: int
    full_prefill_s: float
    fused_s: float
    speedup: float
    recomputed_tokens: int
    chunk_bytes_moved: int
    """Bytes of stored chunk K/V copied to the device for one fused query."""
    fused_resident_s: float
    """The fusion with the stored chunks already in device memory (no host copy)."""
    fused_phases_s: dict[str, float]
    """The fusion's own phase timings (place, select, recompute), host clock."""
    decode_ms_per_token: float
    decode_floor_ms: float
    """Weights + the K/V rows of this length read once, at the measured copy bandwidth."""
    decode_bytes_per_step: int
    first_token_kl_sanity: float
    ingest_tokens_per_s: float
    """Chunk K/V computed (after the prefix) per second, as ingestion does."""


@dataclass(frozen=True)
class GeometryBenchResult:
    config: GeometryBenchConfig
    device_name: str
    weight_bytes: int
    copy_bandwidth_gb_s: float
    results: list[LengthResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def random_model(geometry: Geometry, device: str, dtype: str, seed: int, max_positions: int) -> CausalLM:
    """A model of `geometry` with N(0, 0.02) weights and unit norms, made on `device`."""
    spec = model_spec(geometry, max_positions)
    numerics = Numerics(dtype=dtype, kv_cache_dtype=dtype, weights=dtype, prefill_weights=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, columns: int) -> Linear:
        weight = torch.randn(rows, columns, device=device, generator=generator).mul_(0.02)
        return Linear(weight, numerics)

    def ones() -> torch.Tensor:
        return torch.ones(geometry.hidden, device=device, dtype=numerics.hidden_dtype)

    qkv_rows = (geometry.q_heads + 2 * geometry.kv_heads) * geometry.head_dim
    layers = [
        LayerWeights(
            input_norm=ones(),
            qkv=matrix(qkv_rows, geometry.hidden),
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=matrix(geometry.hidden, geometry.q_heads * geometry.head_dim),
            post_attention_norm=ones(),
            gate_up=matrix(2 * geometry.intermediate, geometry.hidden),
            down=matrix(geometry.hidden, geometry.intermediate),
        )
        for _ in range(geometry.layers)
    ]
    embed = torch.randn(geometry.vocab, geometry.hidden, device=device, generator=generator).to(numerics.hidden_dtype)
    lm_head = matrix(geometry.vocab, geometry.hidden)
    weights = ModelWeights(embed=embed, layers=layers, final_norm=ones(), lm_head=lm_head)
    return CausalLM(spec, weights, numerics, device)


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads of the weights: every matrix of every layer and the LM head
    (the embedding is one row, the norms are negligible but counted)."""
    total = model.weights.lm_head.few_rows.weight_t.nbytes + model.weights.final_norm.nbytes
    for layer in model.weights.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            total += linear.few_rows.weight_t.nbytes
        total += layer.input_norm.nbytes + layer.post_attention_norm.nbytes
    return total


def copy_bandwidth(device: str, gigabytes: float = 2.0) -> float:
    """Bytes/s a device-to-device copy moves, counting bytes read and written."""
    elements = int(gigabytes * 2**30) // 4
    source = torch.empty(elements, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    times = [_timed(device, lambda: target.copy_(source))[0] for _ in range(5)]
    return 2 * source.nbytes / min(times[1:])


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: str, fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of `fn`, the device's queued work included."""
    _sync(device)
    started = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - started, result


def _nbytes(stored) -> int:
    if isinstance(stored, torch.Tensor):
        return stored.nbytes
    return sum(t.nbytes for t in (stored.codes, stored.scale, stored.minimum))


def _host_chunks(model: CausalLM, ids: list[torch.Tensor], prefix_cache, storage: str):
    """The chunks' K/V as the store gives them (packed in `storage`, in host memory) and the
    seconds computing them took on the device."""
    fmt = KV_STORAGE_FORMATS[storage]
    chunks, seconds = [], 0.0
    for tokens in ids:
        took, kv = _timed(str(model.device), lambda t=tokens: model.chunk_kv(t, prefix_cache))
        seconds += took
        keys, values = fmt.unpack({name: t.cpu() for name, t in fmt.pack(*kv).items()})
        chunks.append(LoadedChunk(tokens.tolist(), keys, values))
    return chunks, seconds


def measure_length(model: CausalLM, config: GeometryBenchConfig, length: int, floor_bandwidth: float) -> LengthResult:
    device = str(model.device)
    generator = torch.Generator().manual_seed(config.seed + length)
    vocab = model.spec.vocab_size
    n_chunks = max(1, round((length - PREFIX_TOKENS - QUESTION_TOKENS) / CHUNK_TOKENS))
    prefix = torch.randint(0, vocab, (PREFIX_TOKENS,), generator=generator)
    chunk_ids = [torch.randint(0, vocab, (CHUNK_TOKENS,), generator=generator) for _ in range(n_chunks)]
    question = torch.randint(0, vocab, (QUESTION_TOKENS,), generator=generator)
    whole = torch.cat([prefix, *chunk_ids, question])

    prefix_cache = model.new_cache(PREFIX_TOKENS)
    model.prefill(prefix, prefix_cache)
    chunks, ingest_s = _host_chunks(model, chunk_ids, prefix_cache, config.kv_storage)
    fusion_input = FusionInput(prefix.tolist(), chunks, question.tolist(), chunk_precompute_offset=PREFIX_TOKENS)
    strategy = build_strategy(config.strategy)

    def full():
        cache = model.new_cache(whole.numel() + config.decode_steps)
        return model.prefill(whole, cache), cache

    full_runs = [_timed(device, full) for _ in range(config.repeats)]
    fused_runs = [
        _timed(device, lambda: strategy.fuse(model, fusion_input, prefix_cache, extra_capacity=config.decode_steps))
        for _ in range(config.repeats)
    ]
    resident_input = replace(
        fusion_input, chunks=[LoadedChunk(c.token_ids, c.keys.to(device), c.values.to(device)) for c in chunks]
    )
    resident_runs = [
        _timed(device, lambda: strategy.fuse(model, resident_input, prefix_cache, extra_capacity=config.decode_steps))
        for _ in range(config.repeats)
    ]
    full_s, fused_s, resident_s = (
        statistics.median(seconds for seconds, _ in runs) for runs in (full_runs, fused_runs, resident_runs)
    )
    result = fused_runs[-1][1]
    logits, cache = full_runs[-1][1]

    token, steps = int(logits.argmax()), []
    for _ in range(config.decode_steps):
        took, step_logits = _timed(device, lambda t=token: model.decode_step(t, cache))
        steps.append(took)
        token = int(step_logits.argmax())
    spec = model.spec
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * length * model.dtype.itemsize
    step_bytes = weight_bytes(model) + kv_bytes
    return LengthResult(
        prompt_tokens=whole.numel(),
        chunks=n_chunks,
        full_prefill_s=full_s,
        fused_s=fused_s,
        speedup=full_s / fused_s,
        recomputed_tokens=result.recomputed_tokens,
        chunk_bytes_moved=sum(_nbytes(c.keys) + _nbytes(c.values) for c in chunks),
        fused_resident_s=resident_s,
        fused_phases_s=dict(result.timings),
        decode_ms_per_token=1000 * statistics.median(steps[2:] or steps),
        decode_floor_ms=1000 * step_bytes / floor_bandwidth,
        decode_bytes_per_step=step_bytes,
        first_token_kl_sanity=float(next_token_kl(logits.float().cpu(), result.logits.float().cpu())),
        ingest_tokens_per_s=n_chunks * CHUNK_TOKENS / ingest_s,
    )


def run_geometry_bench(config: GeometryBenchConfig, progress: Callable[[str], None] = print) -> GeometryBenchResult:
    device = config.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device")
    positions = max(config.lengths) + config.decode_steps + 64
    model = random_model(config.geometry, device, config.dtype, config.seed, positions)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    gib = weight_bytes(model) / 2**30
    progress(f"{config.geometry.name} on {name}: weights {gib:.1f} GiB, copy {bandwidth / 1e9:.0f} GB/s")
    # warm-up: kernels compiled, allocator primed, so the first length is not charged for them
    measure_length(model, replace(config, repeats=1, decode_steps=2), min(config.lengths), bandwidth)
    results = []
    for length in config.lengths:
        row = measure_length(model, config, length, bandwidth)
        progress(
            f"{row.prompt_tokens} tokens: full {row.full_prefill_s * 1000:.0f} ms, fused {row.fused_s * 1000:.0f} ms "
            f"({row.speedup:.1f}x; {row.fused_resident_s * 1000:.0f} ms from device memory), "
            f"decode {row.decode_ms_per_token:.2f} ms/token (floor {row.decode_floor_ms:.2f})"
        )
        results.append(row)
    return GeometryBenchResult(config, name, weight_bytes(model), bandwidth / 1e9, results)
