"""Fusion: turn stored chunk KV plus a question into a cache that decodes like a full prefill.

The shared procedure (template method) is:
  1. place the prefix KV (exact, cached per engine) and every chunk's stored KV, keys
     rotated to their global positions (position recovery), into one preallocated cache;
     the strategy then names the rows recomputed from layer 0 (it may read that cache);
  2. run the rows the strategy names through layer 0 onward; at the strategy's check
     layer (if any) it sees the fresh projections of the current rows and keeps a subset;
     every computed row's K/V overwrites the cached K/V of that row at that layer;
  3. the last question row's output gives the first token's logits.
Each strategy supplies only its rows and its selection rule.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ragkv.engine import pacing
from ragkv.engine.attention import causal_attention
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM, Projection
from ragkv.fusion.layout import FusionInput, Layout
from ragkv.kernels.place_kv import layers_of, place_keys, place_values

WHOLE_PASS_PREFIX_ROWS = 256
WHOLE_PASS_SHARE = 0.5
"""When the fresh rows (no stored K/V) are at least this share of the rows after a prefix
of at most WHOLE_PASS_PREFIX_ROWS (a prompt of mostly new passages), every row is
recomputed, the prefix's as it was: each layer is then one causal pass from row 0 (the
fused kernel), which costs less than the masked attention of those rows over the whole
cache. Rows a strategy chooses among stored ones never trigger it (its ratio keeps its
meaning)."""


def whole_pass(layout: Layout, fresh_rows: int) -> bool:
    after_prefix = layout.length - layout.prefix_len
    return 0 < layout.prefix_len <= WHOLE_PASS_PREFIX_ROWS and fresh_rows >= WHOLE_PASS_SHARE * after_prefix


@dataclass
class Preview:
    """What a strategy saw of the prompt while choosing its rows, kept on the result for its
    `after_fuse` (the probe's escalation); empty where it ran no pass over the placed cache."""

    logits: torch.Tensor | None = None
    """The last question row's next-token logits over the placed cache, before the recompute."""
    columns: torch.Tensor | None = None
    """The cache rows the pass read (ascending; None: every row): not the fresh chunks' rows,
    which were not computed yet, nor the middle of a long prefix."""
    scores: torch.Tensor | None = None
    """Each reused document row's score (Layout.reused_document_rows order)."""


@dataclass
class FusionResult:
    cache: KVCache
    logits: torch.Tensor
    layout: Layout
    recomputed_tokens: int
    """Document tokens recomputed beyond the check layer (the budget the ratio sets)."""
    reused_tokens: int
    initial_rows: torch.Tensor
    """Rows recomputed at layers below the check layer (all layers when there is none)."""
    final_rows: torch.Tensor
    """Rows recomputed from the check layer on; rows in neither kept their stored K/V."""
    check_layer: int | None
    timings: dict[str, float] = field(default_factory=dict)
    selection: dict[str, float] = field(default_factory=dict)
    """What the check-layer rule reports about this request (see SelectionContext.report)."""
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    """Pre-RoPE keys and values [layers, kv_heads, rows, D] of the fresh chunks' rows
    (Layout.fresh_rows), as computed here: what the store keeps of a new passage."""
    preview: Preview = field(default_factory=Preview)

    def fresh_chunk_kv(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values of one fresh chunk (an index into the fusion's chunks)."""
        if self.fresh_kv is None or chunk not in self.layout.fresh_chunks:
            raise ValueError(f"chunk {chunk} was not computed by this fusion")
        offset = 0
        for index in self.layout.fresh_chunks:
            start, end = self.layout.chunk_spans[index]
            if index == chunk:
                keys, values = self.fresh_kv
                return keys[:, :, offset : offset + end - start], values[:, :, offset : offset + end - start]
            offset += end - start
        raise AssertionError("unreachable")

    def recomputed_rows(self, layer: int) -> torch.Tensor:
        """Rows whose K/V at `layer` were computed for this prompt (not reused)."""
        if self.check_layer is None or layer < self.check_layer:
            return self.initial_rows
        return self.initial_rows if layer == self.check_layer else self.final_rows


@dataclass(frozen=True)
class SelectionContext:
    """What a check-layer rule may look at."""

    model: CausalLM
    layer: int
    layout: Layout
    rows: torch.Tensor  # the rows (positions) whose projections are given
    projection: Projection  # fresh q/k/v of `rows` at `layer`
    cache: KVCache  # still holds the reused K/V of `rows` at `layer`
    report: dict[str, float] = field(default_factory=dict)
    """Per-request figures the rule reports (budget spent, attention mass covered, ...)."""


class FusionStrategy(ABC):
    """One way to choose which rows are recomputed. Subclasses are small dataclasses."""

    name: str = ""

    def __post_init__(self) -> None:
        """Subclasses validate their fields here."""

    # -- what strategies define --------------------------------------------------------

    @abstractmethod
    def initial_rows(self, layout: Layout) -> torch.Tensor:
        """Rows recomputed from layer 0 (the question rows must be among them)."""

    def rows_for(
        self, model: CausalLM, cache: KVCache, layout: Layout, report: dict[str, float], preview: Preview
    ) -> torch.Tensor:
        """The rows recomputed from layer 0 once the reused KV is placed in `cache`:
        `initial_rows` unless the strategy looks at that cache first (it may write the
        question rows' K/V there, which the recompute overwrites, and note in `preview` what
        it saw)."""
        return self.initial_rows(layout)

    reuses_stored_kv: bool = True
    """False for strategies that recompute every row (nothing stored is placed)."""

    check_layer: int | None = None
    """Layer at which `select` narrows the rows; None = the initial rows go all the way."""

    def select(self, context: SelectionContext) -> torch.Tensor:
        """Indices into `context.rows` that continue past the check layer (the question
        rows are always added by the caller)."""
        raise NotImplementedError(f"{self.name} has no check layer")

    def document_columns(self, model: CausalLM, layout: Layout) -> torch.Tensor | None:
        """The cache rows (ascending) that recomputed rows before the question read; None =
        every earlier row, as the model's attention does. The question rows always read
        every row."""
        return None

    def chunk_key_positions(self, layout: Layout, fusion_input: FusionInput, chunk: int) -> torch.Tensor:
        """Positions the chunk's stored keys are rotated to: global by default."""
        start, end = layout.chunk_spans[chunk]
        return torch.arange(start, end)

    # -- the shared procedure ------------------------------------------------------------

    @torch.inference_mode()
    def fuse(
        self,
        model: CausalLM,
        fusion_input: FusionInput,
        prefix_cache: KVCache | None,
        extra_capacity: int = 0,
        *,
        in_place: bool = False,
    ) -> FusionResult:
        """`in_place`: build the fused cache inside `prefix_cache` (grown when needed) after
        its rows instead of copying them into a new one, so a long prefix (a cached
        conversation a follow-up fuses one new chunk into) costs nothing in proportion to
        its length; its rows are only read. Strategies that recompute the prefix (full)
        still copy."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        layout = Layout.of(fusion_input)
        extra_capacity = max(extra_capacity, self.rows_after_prompt())
        if in_place and self.reuses_stored_kv and layout.prefix_len and prefix_cache is not None:
            if prefix_cache.length != layout.prefix_len:
                raise ValueError("the prefix KV must be given and match the prefix length")
            cache = prefix_cache
            cache.reserve(layout.length + extra_capacity)
            self._place_chunks(model, cache, layout, fusion_input)
        else:
            cache = model.new_cache(layout.length + extra_capacity)
            self._place_reused_kv(model, cache, layout, fusion_input, prefix_cache)
        cache.length = cache.next_position = layout.length
        timings["place_kv"] = time.perf_counter() - started

        report: dict[str, float] = {}
        preview = Preview()
        fresh = layout.fresh_rows.to(model.device)
        rows = self.rows_for(model, cache, layout, report, preview).to(model.device)
        if fresh.numel():
            rows = torch.cat((rows, fresh)).unique(sorted=True)
        if whole_pass(layout, int(fresh.numel())):
            rows = torch.arange(layout.length, device=model.device)
        initial_rows = rows
        context = mean_position(rows)
        timings["select_rows"] = time.perf_counter() - started - timings["place_kv"]
        hidden = model.embed(layout.token_ids.to(model.device)[rows])
        columns = self.document_columns(model, layout)
        recomputed_after_check = None
        fresh_kv = fresh_buffers(model, fresh.numel())
        for layer in range(model.spec.num_layers):
            projection = model.project(layer, hidden, rows)
            if fresh_kv is not None:
                where = torch.isin(rows, fresh)
                fresh_kv[0][layer], fresh_kv[1][layer] = projection.k_pre_rope[:, where], projection.v[:, where]
            if layer == self.check_layer:
                chosen = self.select(SelectionContext(model, layer, layout, rows, projection, cache, report))
                question = ((rows >= layout.question_start) | torch.isin(rows, fresh)).nonzero().flatten()
                keep = torch.cat((chosen.to(rows.device), question)).unique(sorted=True)
                cache.keys[layer, :, rows] = projection.k
                cache.values[layer, :, rows] = projection.v
                rows, hidden = rows[keep], hidden[keep]
                projection = projection.of_rows(keep)
                recomputed_after_check = rows
                context = mean_position(rows)
            else:
                cache.keys[layer, :, rows] = projection.k
                cache.values[layer, :, rows] = projection.v
            if layer + 1 == model.spec.num_layers:
                # every row's K/V is written; only the last row's output is read (the logits)
                hidden = model.finish_last_row(layer, hidden, projection, rows, cache, layout.length)
                pacing.spent(rows.numel() / model.spec.num_layers, context)
            else:
                hidden = finish_in_pieces(model, layer, projection, rows, hidden, cache, layout, columns, context)
        if int(rows[-1]) != layout.length - 1:
            raise RuntimeError(f"{self.name}: the last question row must be recomputed")
        logits = model.logits(hidden[-1:])[0]
        timings["recompute"] = time.perf_counter() - started - timings["place_kv"] - timings["select_rows"]

        final_rows = recomputed_after_check if recomputed_after_check is not None else rows
        in_documents = (final_rows >= layout.prefix_len) & (final_rows < layout.question_start)
        document = int((in_documents & ~torch.isin(final_rows, fresh)).sum())
        result = FusionResult(
            cache,
            logits,
            layout,
            document,
            layout.num_reused_document_tokens - document,
            initial_rows,
            final_rows,
            self.check_layer,
            timings,
            report,
            fresh_kv,
            preview,
        )
        return self.after_fuse(model, result)

    def rows_after_prompt(self) -> int:
        """Cache rows past the prompt the strategy itself writes before it returns (decoded
        drafts), reserved with the fused cache so they never grow (copy) it."""
        return 0

    def after_fuse(self, model: CausalLM, result: FusionResult) -> FusionResult:
        """A second pass over the fused cache (the probe's answer refresh); none by default."""
        return result

    def _place_reused_kv(self, model, cache, layout, fusion_input, prefix_cache) -> None:
        if not self.reuses_stored_kv:
            return
        if layout.prefix_len:
            if prefix_cache is None or prefix_cache.length != layout.prefix_len:
                raise ValueError("the prefix KV must be given and match the prefix length")
            cache.keys[:, :, : layout.prefix_len] = prefix_cache.keys[:, :, : layout.prefix_len]
            cache.values[:, :, : layout.prefix_len] = prefix_cache.values[:, :, : layout.prefix_len]
        self._place_chunks(model, cache, layout, fusion_input)

    def _place_chunks(self, model, cache, layout, fusion_input) -> None:
        for index, chunk in enumerate(fusion_input.chunks):
            if chunk.fresh:  # computed at every layer by the recompute
                continue
            start, end = layout.chunk_spans[index]
            positions = self.chunk_key_positions(layout, fusion_input, index).to(model.device)
            # Integer-coded chunks are dequantised inside these writes (kernels.place_kv); each
            # run of layers is rotated with its own RoPE base (Gemma 3: local vs global layers).
            for layers, rotary in model.rope_runs():
                cos, sin = rotary.cos_sin(positions)
                place_keys(cache.keys[layers, :, start:end], layers_of(chunk.keys, layers), cos, sin)
            place_values(cache.values[:, :, start:end], chunk.values)


def attend(
    model: CausalLM,
    layer: int,
    projection: Projection,
    rows: torch.Tensor,
    cache: KVCache,
    layout: Layout,
    columns: torch.Tensor | None,
) -> torch.Tensor:
    """The recomputed rows' attention at `layer`: rows before the question read only
    `columns` when given (positions renumbered within them, so causality and a sliding
    window hold), the question rows every row."""
    before = int((rows < layout.question_start).sum())
    if columns is None or not before or cache.first_row(layer):
        return model.attend(layer, projection, rows, cache, layout.length)
    keys, values = cache.layer(layer, layout.question_start)
    columns = columns.to(keys.device)
    shift = columns.numel() - int(columns[-1]) - 1  # the columns' tail is contiguous up to the question
    documents = causal_attention(
        projection.q[:, :before],
        keys[:, columns],
        values[:, columns],
        rows[:before] + shift,
        model.scale,
        window=model.spec.layer_window(layer),
    )
    if before == rows.numel():
        return documents
    question = model.attend(layer, projection.of_rows(slice(before, None)), rows[before:], cache, layout.length)
    return torch.cat((documents, question), dim=1)


def mean_position(rows: torch.Tensor) -> float:
    """The rows each recomputed row attends to on average (those before it), for a pacer's
    weighing; read only under one (on a GPU it waits for the device)."""
    return float(rows.float().mean()) if pacing.current() is not None else 0.0


def finish_in_pieces(
    model: CausalLM,
    layer: int,
    projection: Projection,
    rows: torch.Tensor,
    hidden: torch.Tensor,
    cache: KVCache,
    layout: Layout,
    columns: torch.Tensor | None,
    context: float,
) -> torch.Tensor:
    """The rows' attention and the rest of `layer`, in pieces of rows a pacer sizes (one
    piece without one). Every row's K/V of the layer is in the cache already, so a piece's
    queries read the same rows a whole pass would; the rest of the layer is per row."""
    finished = None
    for part in pacing.layer_pieces(rows.numel(), model.spec.num_layers, context):
        if part.start == 0 and part.stop == rows.numel():
            attention = attend(model, layer, projection, rows, cache, layout, columns)
            finished = model.finish_layer(layer, hidden, attention)
            continue
        finished = torch.empty_like(hidden) if finished is None else finished
        attention = attend(model, layer, projection.of_rows(part), rows[part], cache, layout, columns)
        finished[part] = model.finish_layer(layer, hidden[part], attention)
    return finished


def fresh_buffers(model: CausalLM, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Pre-RoPE key and value buffers [layers, kv_heads, rows, D] for the fresh rows."""
    if not rows:
        return None
    spec = model.spec
    shape = (spec.num_layers, spec.num_kv_heads, rows, spec.head_dim)
    return torch.empty(shape, dtype=model.dtype, device=model.device), torch.empty(
        shape, dtype=model.dtype, device=model.device
    )


def top_k_rows(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the `budget` largest scores, in ascending (position) order."""
    budget = max(0, min(budget, scores.numel()))
    return scores.topk(budget).indices.sort().values


def ratio_budget(ratio: float, layout: Layout) -> int:
    """The ratio's share of the document rows a selection chooses among (stored ones)."""
    return int(round(ratio * layout.num_reused_document_tokens))


def check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio}")
