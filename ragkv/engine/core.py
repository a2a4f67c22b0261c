"""The engine: a loaded model, its tokenizer and prompt layout, and chunk encoding.

Knows no HTTP, no store and no ingestion; those layers call it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from ragkv.engine.config import EngineConfig
from ragkv.engine.fingerprint import model_fingerprint
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
from ragkv.engine.model import CausalLM
from ragkv.engine.model_files import resolve_model_dir, served_name
from ragkv.engine.prompt import ChatPrompt

if TYPE_CHECKING:
    from ragkv.sparse.codebook import A2ATSCodebook

log = logging.getLogger("ragkv.engine")


def chunk_fingerprint(config: EngineConfig, model_dir, spec=None, chunk_prefix_ids: list[int] | None = None) -> str:
    """The fingerprint an Engine of `config` over `model_dir` keys its chunks by, without
    loading the weights (the vLLM connector's scheduler side looks chunks up with it)."""
    if spec is None:
        from transformers import AutoConfig

        from ragkv.engine.model_spec import ModelSpec

        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    if chunk_prefix_ids is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        chunk_prefix_ids = ChatPrompt(tokenizer, config.system_prompt).prefix_ids if config.precompute_prefix else []
    descriptor = KV_STORAGE_FORMATS[config.kv_storage].descriptor
    return model_fingerprint(model_dir, spec, descriptor, chunk_prefix_ids, config.numerics())


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        started = time.perf_counter()
        self.model_dir = resolve_model_dir(config.model)
        self.model_name = served_name(self.model_dir)
        """What the API serves the model as: the folder's name, or `org/name` for a hub id."""
        self.model = CausalLM.load(self.model_dir, device=config.device, numerics=config.numerics())
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.prompt = ChatPrompt(self.tokenizer, config.system_prompt)
        self.eos_token_ids = set(self.model.spec.eos_token_ids)
        """Tokens that end an answer (the model config's and the tokenizer's)."""
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.kv_format = KV_STORAGE_FORMATS[config.kv_storage]
        self.chunk_prefix_ids = self.prompt.prefix_ids if config.precompute_prefix else []
        self.fingerprint = chunk_fingerprint(config, self.model_dir, self.model.spec, self.chunk_prefix_ids)
        # built now rather than at the first request's first token (a first build takes ~1 min)
        self.model.compiled_decoder()
        self.load_seconds = time.perf_counter() - started
        self._chunk_prefix_cache: KVCache | None = None
        log.info(
            "engine ready in %.1f s (%s; fingerprint %s)", self.load_seconds, self.model.numerics, self.fingerprint
        )

    @property
    def spec(self):
        return self.model.spec

    def tokenize(self, text: str) -> list[int]:
        return self.prompt.encode(text)

    def chunk_prefix_cache(self) -> KVCache | None:
        """KV of the shared precompute prefix (computed once per engine)."""
        if not self.chunk_prefix_ids:
            return None
        if self._chunk_prefix_cache is None:
            cache = self.model.new_cache(len(self.chunk_prefix_ids))
            self.model.prefill(torch.tensor(self.chunk_prefix_ids), cache)
            self._chunk_prefix_cache = cache
        return self._chunk_prefix_cache

    def encode_chunk(self, token_ids: list[int], codebook: A2ATSCodebook | None = None) -> dict[str, torch.Tensor]:
        """The stored form of a chunk: pre-RoPE keys/values [layers, kv_heads, T, D] in the
        storage format (ragkv.engine.kv_storage), the token ids they were computed from, and
        given a `codebook` (ragkv.sparse.A2ATSCodebook) its A2ATS codes [layers, kv_heads, T] int16."""
        keys, values = self.model.chunk_kv(torch.tensor(token_ids), self.chunk_prefix_cache())
        return self.stored_chunk(token_ids, keys, values, codebook)

    def encode_chunks(
        self, chunks: list[list[int]], codebook: A2ATSCodebook | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """`encode_chunk` of several chunks in one model pass (CausalLM.chunk_kv_many), in order."""
        pairs = self.model.chunk_kv_many([torch.tensor(ids) for ids in chunks], self.chunk_prefix_cache())
        return [self.stored_chunk(ids, keys, values, codebook) for ids, (keys, values) in zip(chunks, pairs)]

    def stored_chunk(
        self, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor, codebook: A2ATSCodebook | None = None
    ) -> dict[str, torch.Tensor]:
        # the store keeps host memory: a GPU's K/V is packed there, then copied out once
        packed = {name: tensor.cpu() for name, tensor in self.kv_format.pack(keys, values).items()}
        tensors = {**packed, "tokens": torch.tensor(token_ids, dtype=torch.int32)}
        if codebook is not None:
            # "codes" + "codebook_id", from the keys as stored (what a query reads back), in
            # float32 like the query side, so codes never depend on the compute dtype
            tensors.update(codebook.chunk_tensors(self.kv_format.dense_keys(tensors, torch.float32)))
        return tensors

    def prefill(self, token_ids: list[int], extra_capacity: int = 0) -> tuple[KVCache, torch.Tensor]:
        """Plain full prefill of a prompt into a fresh cache sized for the answer too."""
        cache = self.model.new_cache(len(token_ids) + extra_capacity)
        logits = self.model.prefill(torch.tensor(token_ids), cache)
        return cache, logits
