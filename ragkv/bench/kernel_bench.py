"""`ragkv bench kernels`: the attention-side kernels at a real model's geometry, each checked
against the torch reference and timed, and a random-weight decode step that shows what
sparse decode saves once the weights are read too.

Made for a GPU, where the Triton and FlashInfer paths run; on the CPU the same ops run
through their torch and compiled paths (the tests use a tiny geometry). Random inputs,
never zeros: zeros hide unwritten outputs. The step is Llama-shaped (RMSNorm, fused
QKV, GQA attention over a fixed cache, SwiGLU, LM head) with random weights; positions
and the new token's K/V are left out, as they cost the same in every attention mode.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ragkv import kernels
from ragkv.kernels import reference
from ragkv.kernels.dispatch import BackendUnavailableError

OP_BACKENDS: dict[str, tuple[str, ...]] = {
    "apply_rope": ("torch", "triton"),
    "code_score_topk": ("torch", "triton"),
    "sparse_decode_attention": ("torch", "triton", "flashinfer"),
    "selective_attention": ("torch", "triton", "bf16_flash", "cpu_flash", "cpp"),
    "dense_decode": ("torch", "triton", "flashinfer"),
}
"""The backends each op is timed with (those of CPU_BACKENDS only on CPU tensors). dense_decode
is `kernels.decode_attention` for one request, except its flashinfer entry: FlashInfer's own
single-request decode (`single_decode_with_kv_cache`), the baseline sparse decode must beat."""
CPU_BACKENDS = frozenset({"bf16_flash", "cpu_flash", "cpp"})

STEP_MODES = ("dense-torch", "dense-triton", "dense-flashinfer", "sparse-triton", "sparse-flashinfer")
"""Attention in the random-weight step: dense over every row (`kernels.decode_attention`, or
FlashInfer's single decode), or the table-lookup sparse selection (query . centroids,
`code_score_topk`, `sparse_decode_attention` on that backend) at the budget."""


@dataclass(frozen=True)
class Geometry:
    """The shapes of a decoder-only Llama-family model."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    def __post_init__(self) -> None:
        sizes = (self.layers, self.q_heads, self.kv_heads, self.head_dim, self.hidden, self.intermediate, self.vocab)
        if min(sizes) < 1:
            raise ValueError(f"geometry {self.name}: every size must be >= 1, got {sizes}")
        if self.q_heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"geometry {self.name}: q_heads must be a multiple of kv_heads and head_dim even")


GEOMETRIES: dict[str, Geometry] = {
    geometry.name: geometry
    for geometry in (
        Geometry(
            "llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=128256
        ),
        Geometry(
            "smollm2-135m", layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152
        ),
    )
}


@dataclass(frozen=True)
class KernelBenchConfig:
    geometry: Geometry
    contexts: tuple[int, ...] = (8192, 16384, 32768)
    dtype: torch.dtype = torch.bfloat16
    budget: float = 0.06
    codebook_size: int = 1024
    recompute_ratio: float = 0.15
    ops: tuple[str, ...] = tuple(OP_BACKENDS)
    step_modes: tuple[str, ...] = STEP_MODES
    device: str = "cuda"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 16:
            raise ValueError(f"contexts must be >= 16 rows each, got {self.contexts}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype}")
        if not 0 < self.budget <= 1 or not 0 < self.recompute_ratio <= 1:
            raise ValueError("budget and recompute_ratio must be in (0, 1]")
        if not 2 <= self.codebook_size <= 2**15:
            raise ValueError(f"codebook_size must be in [2, 32768] (int16 codes), got {self.codebook_size}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a torch device (e.g. cuda, cuda:1, cpu)") from exc
        unknown = sorted(set(self.ops) - set(OP_BACKENDS)) + sorted(set(self.step_modes) - set(STEP_MODES))
        if unknown:
            raise ValueError(
                f"unknown op(s) or step mode(s) {unknown}; ops: {list(OP_BACKENDS)}, step modes: {list(STEP_MODES)}"
            )

    def selected(self, context: int) -> int:
        return max(1, math.ceil(self.budget * context))


@dataclass(frozen=True)
class KernelRow:
    """One op on one backend at one context: median ms, and the output's relative error
    ||out - ref|| / ||ref|| against the torch reference on the same inputs (None when the
    backend could not run; `error` then says why)."""

    op: str
    context: int
    backend: str
    ms: float | None
    rel_err: float | None
    shape: str
    timing: str = ""
    error: str = ""


@dataclass(frozen=True)
class StepRow:
    """One random-weight decode step (every layer, the LM head) at one context."""

    context: int
    mode: str
    ms: float | None
    selected_rows: int
    timing: str
    plans_per_step: float | None = None
    error: str = ""


@dataclass
class KernelBenchResult:
    device: str
    versions: dict[str, str]  # package -> version, "absent" when it does not import
    config: KernelBenchConfig
    kernels: list[KernelRow] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        config = {**asdict(self.config), "dtype": str(self.config.dtype).removeprefix("torch.")}
        return {
            "device": self.device,
            "versions": self.versions,
            "config": config,
            "note": self.note,
            "kernels": [asdict(row) for row in self.kernels],
            "steps": [asdict(row) for row in self.steps],
        }


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, on out's device."""
    out, ref = out.double(), ref.double().to(out.device)
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def replayed_ms(fn: Callable[[], object], device: torch.device, repeats: int = 50) -> tuple[float, str]:
    """(median ms, how it was timed). On a GPU fn is captured once as a CUDA graph and the
    replays are timed: one token's ops are tiny, and timed eagerly they measure the host's
    launch speed, not the GPU (ops that sync with the host cannot be captured and stay
    eager). fn has run once before, so kernels are compiled and FlashInfer planned."""
    if device.type != "cuda":
        return median_ms(fn, device, repeats), "eager"
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return median_ms(fn, device, repeats), "eager"
    return median_ms(graph.replay, device, repeats), "cuda-graph"


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 50) -> float:
    """Median wall time of fn. On a GPU, Triton's do_bench: CUDA events, and the L2 cache
    flushed before every run, so a layer's cache is read from memory as in a real step."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=repeats * 2, return_mode="median"))
    fn()
    times = []
    for _ in range(max(3, repeats // 10)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class OpInputs:
    """Random inputs of every op at one context, on the device."""

    def __init__(self, config: KernelBenchConfig, context: int, device: torch.device):
        g, dtype = config.geometry, config.dtype
        gen = torch.Generator(device="cpu").manual_seed(config.seed + context)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        self.scale = 1.0 / math.sqrt(g.head_dim)
        self.keys = randn(g.kv_heads, context, g.head_dim)
        self.values = randn(g.kv_heads, context, g.head_dim)
        self.query = randn(g.q_heads, g.head_dim)
        selected = config.selected(context)
        self.indices = torch.stack(
            [torch.randperm(context, generator=gen)[:selected].sort().values for _ in range(g.kv_heads)]
        ).to(device)
        self.table = torch.randn(g.kv_heads, config.codebook_size, generator=gen).to(device)
        self.codes = torch.randint(0, config.codebook_size, (g.kv_heads, context), generator=gen, dtype=torch.int16).to(
            device
        )
        self.selected = selected
        recompute = max(1, round(config.recompute_ratio * context))
        self.row_positions = torch.randperm(context, generator=gen)[:recompute].sort().values.to(device)
        self.q_rows = randn(g.q_heads, recompute, g.head_dim)
        angles = torch.rand(context, g.head_dim // 2, generator=gen) * 2 * math.pi
        self.cos = torch.cat([angles.cos()] * 2, dim=-1).to(device)
        self.sin = torch.cat([angles.sin()] * 2, dim=-1).to(device)

    @functools.cached_property
    def reference_scores(self) -> torch.Tensor:
        """Every row's code score [Hkv, T], by the reference."""
        return reference.code_scores(self.table, self.codes, None)


def _dense_flashinfer(inputs: OpInputs) -> torch.Tensor:
    import flashinfer

    return flashinfer.single_decode_with_kv_cache(
        inputs.query, inputs.keys, inputs.values, kv_layout="HND", sm_scale=inputs.scale
    )


def _op_call(op: str, backend: str, inputs: OpInputs) -> tuple[Callable[[], object], Callable[[object], torch.Tensor]]:
    """(the timed call, what of its result is compared with the reference)."""
    x = inputs
    if op == "apply_rope":
        return lambda: kernels.apply_rope(x.keys, x.cos, x.sin, backend=backend), lambda out: out
    if op == "code_score_topk":
        # compared by the reference scores of the rows chosen: ties may pick other rows of equal score
        return (
            lambda: kernels.code_score_topk(x.table, x.codes, x.selected, backend=backend),
            lambda out: torch.gather(x.reference_scores, 1, out[1]),
        )
    if op == "sparse_decode_attention":
        return (
            lambda: kernels.sparse_decode_attention(x.query, x.keys, x.values, x.indices, x.scale, backend=backend),
            lambda out: out,
        )
    if op == "selective_attention":
        return (
            lambda: kernels.selective_attention(x.q_rows, x.keys, x.values, x.row_positions, x.scale, backend=backend),
            lambda out: out,
        )
    if op == "dense_decode":
        if backend == "flashinfer":
            return lambda: _dense_flashinfer(x), lambda out: out
        return (
            lambda: kernels.decode_attention(
                x.query[None], [x.keys], [x.values], [x.keys.shape[1]], x.scale, backend=backend
            )[0],
            lambda out: out,
        )
    raise ValueError(f"unknown op {op!r}")


def reference_output(op: str, inputs: OpInputs) -> torch.Tensor:
    x = inputs
    if op == "apply_rope":
        return reference.rope(x.keys.float(), x.cos, x.sin)
    if op == "code_score_topk":
        return reference.code_score_topk(x.table, x.codes, x.selected, None)[0]
    if op == "sparse_decode_attention":
        return reference.sparse_decode_attention(x.query.float(), x.keys, x.values, x.indices, x.scale, None)[0]
    if op == "selective_attention":
        return reference.selective_attention(x.q_rows.float(), x.keys, x.values, x.row_positions, x.scale)
    everything = torch.arange(x.keys.shape[1], device=x.keys.device).expand(x.keys.shape[0], -1)
    return reference.sparse_decode_attention(x.query.float(), x.keys, x.values, everything, x.scale, None)[0]


def _shape(op: str, inputs: OpInputs) -> str:
    hkv, t, d = inputs.keys.shape
    hq = inputs.query.shape[0]
    return {
        "apply_rope": f"x [{hkv}, {t}, {d}]",
        "code_score_topk": f"codes [{hkv}, {t}], C={inputs.table.shape[1]}, k={inputs.selected}",
        "sparse_decode_attention": f"q [{hq}, {d}], cache [{hkv}, {t}, {d}], k={inputs.selected}",
        "selective_attention": f"q_rows [{hq}, {inputs.q_rows.shape[1]}, {d}], cache [{hkv}, {t}, {d}]",
        "dense_decode": f"q [{hq}, {d}], cache [{hkv}, {t}, {d}]",
    }[op]


def bench_op(op: str, backend: str, inputs: OpInputs, expected: torch.Tensor, device: torch.device) -> KernelRow:
    """`op` on `backend`, its output compared with `expected` (`reference_output`)."""
    context = inputs.keys.shape[1]
    call, compared = _op_call(op, backend, inputs)
    try:
        out = compared(call())
        error = relative_error(out, expected)
        ms, timing = replayed_ms(call, device)
    except (BackendUnavailableError, ImportError, torch.cuda.OutOfMemoryError) as exc:
        return KernelRow(op, context, backend, None, None, _shape(op, inputs), error=f"{type(exc).__name__}: {exc}")
    return KernelRow(op, context, backend, ms, error, _shape(op, inputs), timing)


def bench_backends(op: str, inputs: OpInputs, device: torch.device) -> list[KernelRow]:
    """`op` on each of its backends, against one reference output (at 32K some take seconds)."""
    try:
        expected = reference_output(op, inputs)
    except torch.cuda.OutOfMemoryError as exc:
        return [
            KernelRow(
                op,
                inputs.keys.shape[1],
                backend,
                None,
                None,
                _shape(op, inputs),
                error=f"reference: {type(exc).__name__}: {exc}",
            )
            for backend in backends_of(op, device)
        ]
    return [bench_op(op, backend, inputs, expected, device) for backend in backends_of(op, device)]


def backends_of(op: str, device: torch.device) -> tuple[str, ...]:
    """The backends `op` is timed with on `device`."""
    return tuple(b for b in OP_BACKENDS[op] if device.type == "cpu" or b not in CPU_BACKENDS)


class RandomLlama:
    """Random weights of `geometry`, and a fixed KV cache per layer (with A2ATS-style codes
    and centroids for the sparse modes) at the context last set by `use_context`."""

    def __init__(self, config: KernelBenchConfig, device: torch.device):
        g, dtype = config.geometry, config.dtype
        torch.manual_seed(config.seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) / math.sqrt(cols)

        self.config, self.geometry, self.device = config, g, device
        qkv = (g.q_heads + 2 * g.kv_heads) * g.head_dim
        self.qkv = [weight(qkv, g.hidden) for _ in range(g.layers)]
        self.out = [weight(g.hidden, g.q_heads * g.head_dim) for _ in range(g.layers)]
        self.gate_up = [weight(2 * g.intermediate, g.hidden) for _ in range(g.layers)]
        self.down = [weight(g.hidden, g.intermediate) for _ in range(g.layers)]
        self.lm_head = weight(g.vocab, g.hidden)
        self.norm = torch.ones(g.hidden, device=device, dtype=dtype)
        self.centroids = [
            torch.randn(g.kv_heads, g.head_dim, config.codebook_size, device=device) for _ in range(g.layers)
        ]
        self.x = torch.randn(1, g.hidden, device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(g.head_dim)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.codes: list[torch.Tensor] = []

    def use_context(self, context: int) -> None:
        """Contiguous caches of exactly `context` rows (the old ones freed first)."""
        g, dtype, device = self.geometry, self.config.dtype, self.device
        self.keys, self.values, self.codes = [], [], []
        for _ in range(g.layers):
            self.keys.append(torch.randn(g.kv_heads, context, g.head_dim, device=device, dtype=dtype))
            self.values.append(torch.randn(g.kv_heads, context, g.head_dim, device=device, dtype=dtype))
            self.codes.append(
                torch.randint(0, self.config.codebook_size, (g.kv_heads, context), device=device, dtype=torch.int16)
            )

    def attention(self, mode: str, layer: int, q: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        keys, values = self.keys[layer], self.values[layer]
        context = keys.shape[1]
        if mode in ("dense-torch", "dense-triton"):
            backend = mode.removeprefix("dense-")
            return kernels.decode_attention(q[None], [keys], [values], [context], self.scale, backend=backend)[0]
        if mode == "dense-flashinfer":
            import flashinfer

            return flashinfer.single_decode_with_kv_cache(q, keys, values, kv_layout="HND", sm_scale=self.scale)
        backend = mode.removeprefix("sparse-")
        summed = q.float().view(g.kv_heads, -1, g.head_dim).sum(1, keepdim=True)  # [Hkv, 1, D]
        table = torch.bmm(summed, self.centroids[layer]).squeeze(1)
        _, rows = kernels.code_score_topk(table, self.codes[layer], self.config.selected(context))
        return kernels.sparse_decode_attention(q, keys, values, rows, self.scale, backend=backend)

    def step(self, mode: str) -> torch.Tensor:
        g = self.geometry
        x = self.x
        q_width = g.q_heads * g.head_dim
        for layer in range(g.layers):
            h = F.rms_norm(x, (g.hidden,), self.norm)
            q = (h @ self.qkv[layer].T)[0, :q_width].view(g.q_heads, g.head_dim)
            x = x + self.attention(mode, layer, q).reshape(1, q_width) @ self.out[layer].T
            gate, up = (F.rms_norm(x, (g.hidden,), self.norm) @ self.gate_up[layer].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.down[layer].T
        return F.rms_norm(x, (g.hidden,), self.norm) @ self.lm_head.T


def time_step(model: RandomLlama, mode: str, device: torch.device) -> tuple[float, str]:
    """(median ms, how it was timed) of one step, replayed as a CUDA graph on a GPU."""

    def run() -> torch.Tensor:
        return model.step(mode)

    run()  # compiles kernels and plans FlashInfer before any capture
    return replayed_ms(run, device, repeats=20)


def _bench_step(model: RandomLlama, mode: str, context: int, device: torch.device) -> StepRow:
    selected = model.config.selected(context) if mode.startswith("sparse") else context
    plans = None
    if mode == "sparse-flashinfer":
        from ragkv.kernels.flashinfer.sparse_attention import plans_made

        model.step(mode)  # the first step of a new context plans once; count the steps after it
        before = plans_made()
        model.step(mode)
        model.step(mode)
        plans = (plans_made() - before) / 2
    ms, timing = time_step(model, mode, device)
    return StepRow(context, mode, ms, selected, timing, plans)


def run_kernel_bench(config: KernelBenchConfig, progress: Callable[[str], None] = lambda _: None) -> KernelBenchResult:
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    result = KernelBenchResult(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        versions=_versions(),
        config=config,
    )
    with torch.inference_mode():
        for context in config.contexts:
            inputs = OpInputs(config, context, device)
            for op in config.ops:
                for row in bench_backends(op, inputs, device):
                    progress(_format_kernel_row(row))
                    result.kernels.append(row)
            del inputs
        if config.step_modes:
            model = RandomLlama(config, device)
            for context in config.contexts:
                model.use_context(context)
                for mode in config.step_modes:
                    try:
                        row = _bench_step(model, mode, context, device)
                    except (BackendUnavailableError, ImportError) as exc:
                        row = StepRow(context, mode, None, 0, "", error=f"{type(exc).__name__}: {exc}")
                    progress(f"step {context} {mode}: {row.ms} ms ({row.timing}) {row.error}")
                    result.steps.append(row)
    return result


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("triton", "flashinfer"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # absent or broken: the rows that need it say so
            versions[name] = "absent"
    return versions


def _format_kernel_row(row: KernelRow) -> str:
    ms = f"{row.ms:.4f}" if row.ms is not None else "-"
    err = f"{row.rel_err:.1e}" if row.rel_err is not None else "-"
    return f"{row.op:<24} {row.context:>6} {row.backend:<10} {ms:>9} ms  rel_err {err:>8}  {row.timing} {row.error}"


def format_table(result: KernelBenchResult) -> str:
    lines = [
        f"device: {result.device}  versions: {result.versions}",
        "",
        f"{'op':<24} {'context':>6} {'backend':<10} {'ms':>9}     {'rel_err':>15}",
    ]
    lines += [_format_kernel_row(row) for row in result.kernels]
    if result.steps:
        lines += ["", f"{'decode step':<24} {'context':>6} {'mode':<18} {'ms':>9}  {'vs best dense':>14}"]
        baseline = {}
        for row in result.steps:
            if row.mode.startswith("dense") and row.ms:
                baseline[row.context] = min(row.ms, baseline.get(row.context, row.ms))
        for row in result.steps:
            ms = f"{row.ms:.3f}" if row.ms is not None else "-"
            ratio = f"{baseline[row.context] / row.ms:.2f}x" if row.ms and row.context in baseline else "-"
            lines.append(f"{'':<24} {row.context:>6} {row.mode:<18} {ms:>9}  {ratio:>14}  {row.timing} {row.error}")
    return "\n".join(lines)
