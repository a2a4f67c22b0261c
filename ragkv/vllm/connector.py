"""RagkvConnector: ragkv's chunk store and fusion behind vLLM's v1 KV connector API.

    vLLM scheduler ─► get_num_new_matched_tokens: the whole prompt stored, or enough of its
                      passage spans? ─► "all but the last token come from outside"
                   ─► update_state_after_alloc / build_connector_meta: per request, its ids,
                      blocks and what the worker does this step (load rows, save rows)
    vLLM worker    ─► start_load_kv (before the forward): ragkv's rows (a stored prompt, or the
                      fusion of stored spans on ragkv's own copy of the model) written into
                      vLLM's paged blocks with the attention backend's own cache update
                   ─► wait_for_save (after the forward that completes a prompt vLLM computed):
                      its rows read back, stored as the whole prompt and as its new spans

Decisions live in ragkv.vllm.reuse (no vLLM there); the paged layout in ragkv.vllm.paged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from ragkv.fusion import build_strategy
from ragkv.vllm.config import ConnectorConfig
from ragkv.vllm.paged import PagedLayout, slots_of
from ragkv.vllm.reuse import NONE, PREFIX, Decision, Planner, Rows, prefix_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.ragkv")  # under vLLM's logger, so its handlers show these lines

_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(key: tuple, build):
    """One object per process for `key`: the scheduler and the worker share a process under
    vLLM's single-device executor, and an LMDB environment must be opened once per process."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = build()
        return _SHARED[key]


@dataclass
class RequestWork:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    mode: str
    start: int = 0
    """Rows [start, len - 1) are ragkv's to write (below start: vLLM's own prefix cache)."""
    strategy: str | None = None
    """The request's fusion strategy (kv_transfer_params ragkv_strategy); None = the config's."""


@dataclass
class RagkvMetadata(KVConnectorMetadata):
    loads: list[RequestWork] = field(default_factory=list)
    saves: list[RequestWork] = field(default_factory=list)


@dataclass
class _Tracked:
    token_ids: list[int]
    block_ids: list[int]
    decision: Decision
    external: int = 0
    loaded: bool = False
    strategy: str | None = None


class RagkvConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        model_dir = vllm_config.model_config.model
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        engine_config = self.config.engine_config(model_dir, dtype)
        store = _shared(
            ("store", self.config.store_url, self.config.store_secret),
            lambda: _open_store(self.config.store_url, self.config.store_secret),
        )
        self.planner: Planner = _shared(
            ("planner", repr(self.config), repr(engine_config), dtype),
            lambda: _planner(self.config, engine_config, store, dtype),
        )
        self._tracked: dict[str, _Tracked] = {}
        self.rows: Rows | None = None
        if role == KVConnectorRole.WORKER:
            engine = _shared(("engine", repr(engine_config)), lambda: _engine(engine_config))
            self.rows = Rows(self.config, engine, store, self.planner)
            self._layers: dict[str, Any] = {}
            self._layouts: dict[tuple, PagedLayout] = {}
            self._failed_blocks: set[int] = set()
        log.info("RagkvConnector (%s): %s", role.name, self.config)

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        token_ids = list(request.prompt_token_ids or [])
        if request.num_computed_tokens or not token_ids:  # a preempted request resumes on its own
            return 0, False
        params = request.kv_transfer_params or {}
        if params.get("ragkv") == "off":
            return 0, False  # this request opts out: vLLM alone (a fidelity reference)
        strategy = params.get("ragkv_strategy")
        if strategy is not None:
            build_strategy(strategy)  # a bad spec fails this request, not a worker later
        decision = self.planner.decide(token_ids, num_computed_tokens)
        self._tracked[request.request_id] = _Tracked(token_ids, [], decision, strategy=strategy)
        if decision.mode != NONE:
            log.info(
                "request %s: %s, %d of %d tokens from ragkv (%d in stored spans)",
                request.request_id,
                decision.mode,
                decision.tokens,
                len(token_ids),
                decision.reused,
            )
        return decision.tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            tracked.external = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagkvMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._step(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:  # preempted: its blocks are new, vLLM recomputes
                    tracked.block_ids, tracked.external, tracked.loaded = list(new_blocks[0]), 0, True
                else:
                    tracked.block_ids.extend(new_blocks[0])
            self._step(meta, req_id, tracked, cached.num_computed_tokens[index] + scheduled.get(req_id, 0))
        return meta

    def _step(self, meta: RagkvMetadata, req_id: str, tracked: _Tracked, done: int) -> None:
        length = len(tracked.token_ids)
        if tracked.external and not tracked.loaded:
            tracked.loaded = True
            start = length - 1 - tracked.external
            meta.loads.append(
                RequestWork(
                    req_id, tracked.token_ids, list(tracked.block_ids), tracked.decision.mode, start, tracked.strategy
                )
            )
        if done >= length:  # the prompt's prefill ends this step
            self._tracked.pop(req_id, None)
            if tracked.decision.mode == NONE and tracked.external == 0 and length > 1:
                if self.config.save_prefix or self.config.save_spans:
                    meta.saves.append(RequestWork(req_id, tracked.token_ids, list(tracked.block_ids), NONE))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def _attention_layers(self) -> list[tuple[int, str, Any]]:
        found = []
        for name, layer in self._layers.items():
            if getattr(layer, "kv_cache", None) is not None and hasattr(
                getattr(layer, "impl", None), "do_kv_cache_update"
            ):
                found.append((extract_layer_index(name), name, layer))
        return sorted(found, key=lambda item: item[0])

    def _heads(self, cache: torch.Tensor) -> slice:
        """The KV heads this worker's cache holds (a tensor-parallel rank holds a share, and
        replicas of one head when there are more ranks than heads)."""
        total, here = self.rows.engine.spec.num_kv_heads, cache.shape[1]
        if here == total:
            return slice(None)
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if here * ranks == total:
            return slice(rank * here, (rank + 1) * here)
        if here == 1 and ranks > total:
            head = rank * total // ranks
            return slice(head, head + 1)
        raise ValueError(f"cannot tell which of {total} KV heads a cache of {here} holds at rank {rank} of {ranks}")

    def _layout(self, layer: Any) -> PagedLayout:
        cache = layer.kv_cache
        key = (type(layer.impl).__name__, tuple(cache.shape[1:]), cache.dtype, str(cache.device))
        if key not in self._layouts:
            write = lambda k, v, c, s: layer.impl.do_kv_cache_update(layer, k, v, c, s)  # noqa: E731
            self._layouts[key] = PagedLayout(write, cache, cache.shape[1], self.rows.engine.spec.head_dim)
        # the layout is the backend's and the shape's; the write goes through this layer
        return _bound(self._layouts[key], layer)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._layers = forward_context.no_compile_layers
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagkvMetadata)
        for work in meta.loads:
            try:
                self._load(work)
            except Exception:
                # vLLM's kv_load_failure_policy decides: the request fails or recomputes
                # these blocks; the worker and the other requests go on
                log.exception("request %s: ragkv could not provide its rows", work.req_id)
                self._failed_blocks.update(work.block_ids[work.start // self.block_size :])

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _load(self, work: RequestWork) -> None:
        started = time.perf_counter()
        end = len(work.token_ids) - 1
        info: dict = {}
        rows = self.rows.prefix_rows(work.token_ids) if work.mode == PREFIX else None
        if rows is not None:
            keys, values = rows
        else:  # a fusion, or a prompt evicted since the scheduler looked: fuse whatever is there
            keys, values, info = self.rows.fused_rows(work.token_ids, work.strategy)
        slots = slots_of(work.block_ids, self.block_size, work.start, end)
        for index, _, layer in self._attention_layers():
            heads = self._heads(layer.kv_cache)
            self._layout(layer).write_rows(
                layer.kv_cache, slots, keys[index, heads, work.start : end], values[index, heads, work.start : end]
            )
        log.info(
            "request %s: %s wrote rows [%d, %d) in %.3f s %s",
            work.req_id,
            work.mode,
            work.start,
            end,
            time.perf_counter() - started,
            info,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # rows are read back once the forward that completes a prompt is done

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, RagkvMetadata)
        for work in meta.saves:
            started = time.perf_counter()
            end = len(work.token_ids) - 1
            slots = slots_of(work.block_ids, self.block_size, 0, end)
            layers = self._attention_layers()
            partial = len(layers) != self.rows.engine.spec.num_layers
            if partial or any(self._heads(layer.kv_cache) != slice(None) for _, _, layer in layers):
                # a rank holds some layers or heads only: what it could store is not a whole chunk
                log.warning("RagkvConnector saves nothing under tensor or pipeline parallelism (untested there)")
                return
            keys, values = [], []
            for _, _, layer in layers:
                k, v = self._layout(layer).read(layer.kv_cache, slots)
                keys.append(k.cpu())
                values.append(v.cpu())
            saved = self.rows.save(work.token_ids, torch.stack(keys), torch.stack(values), whole=True)
            log.info("request %s: saved %s in %.3f s", work.req_id, saved, time.perf_counter() - started)


def _bound(layout: PagedLayout, layer: Any) -> PagedLayout:
    bound = PagedLayout.__new__(PagedLayout)
    bound.__dict__.update(layout.__dict__)
    bound.write = lambda k, v, c, s: layer.impl.do_kv_cache_update(layer, k, v, c, s)
    return bound


def _open_store(url: str | None, secret: str | None):
    from ragkv.app.storage_config import StorageConfig
    from ragkv.store import open_store

    return open_store(url or StorageConfig().resolved_store_url, secret=secret)


def _planner(config: ConnectorConfig, engine_config, store, vllm_dtype: str) -> Planner:
    from transformers import AutoTokenizer

    from ragkv.app.passages import SpanKeys
    from ragkv.engine.core import chunk_fingerprint
    from ragkv.engine.model_files import resolve_model_dir

    model_dir = resolve_model_dir(engine_config.model)
    fingerprint = chunk_fingerprint(engine_config, model_dir)
    keys = SpanKeys(
        AutoTokenizer.from_pretrained(model_dir), fingerprint, share_across_tenants=config.share_across_tenants
    )
    keys.finder.prepare()
    return Planner(config, keys, store, prefix_fingerprint(fingerprint, vllm_dtype))


def _engine(engine_config):
    from ragkv.engine import Engine

    return Engine(engine_config)
