"""Shared helpers for the sparse decode tests: a tiny random Llama checkpoint and
structured synthetic caches. (Collected by pytest: it also checks the k-means helper.)"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM
from ragkv.sparse.kmeans import kmeans


def write_tiny_llama(
    folder: Path,
    layers: int = 2,
    vocab: int = 512,
    with_tokenizer: bool = False,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    hidden: int = 64,
    rope_scaling: dict | None = None,
) -> Path:
    """A random Llama checkpoint (default GQA: 4 query heads over 2 KV heads, head_dim 16)."""
    if with_tokenizer:
        from ragkv.engine.model_files import resolve_model_dir

        # scripts/gpu-check.sh brings the packaged model's tokenizer files where the package is not
        packaged = Path(os.environ.get("RAGKV_TEST_TOKENIZER") or resolve_model_dir(None))
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.json",
            "merges.txt",
            "chat_template.jinja",
            "generation_config.json",
        ):
            if (packaged / name).is_file():
                shutil.copy(packaged / name, folder / name)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(folder))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling=rope_scaling,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so attention is far from uniform
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.15 if "embed" not in name else 1.0)
    model.save_pretrained(folder)
    return folder


def tiny_model(folder: Path, **kwargs) -> CausalLM:
    return CausalLM.load(write_tiny_llama(folder, **kwargs))


def structured_case(model: CausalLM, rows: int, seed: int = 0, needles: float = 0.05):
    """A cache whose pre-RoPE keys are Gaussian noise plus, on a few 'needle' rows, a strong
    component along a per-(layer, head) direction u in the low-frequency RoPE dims
    (which rotate little), and a decode query aligned with u. Returns (cache, pre-RoPE
    keys [L, Hkv, T, D], query maker, question queries per layer [Hq, Nq, D])."""
    spec = model.spec
    g = torch.Generator().manual_seed(seed)
    layers, heads, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
    half = d // 2
    low = [half - 2, half - 1, d - 2, d - 1]  # the two lowest-frequency rotation pairs
    u = torch.zeros(layers, heads, d)
    u[..., low] = torch.randn(layers, heads, len(low), generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    keys = torch.randn(layers, heads, rows, d, generator=g) * 0.5
    needle = torch.rand(layers, heads, rows, generator=g) < needles
    strength = 3.0 + torch.rand(layers, heads, rows, generator=g) * 3.0
    keys = keys + (needle * strength).unsqueeze(-1) * u.unsqueeze(2)
    cache = model.new_cache(rows + 8)
    positions = torch.arange(rows)
    for layer in range(layers):
        cache.keys[layer, :, :rows] = model.rotary.rotate(keys[layer], positions)
        cache.values[layer, :, :rows] = torch.randn(heads, rows, d, generator=g)
    cache.length = cache.next_position = rows

    def query(layer_seed: int = 0) -> list[torch.Tensor]:
        """Post-RoPE decode queries [Hq, 1, D] per layer, at position `rows` (the next token)."""
        qg = torch.Generator().manual_seed(1000 + layer_seed)
        out = []
        for layer in range(layers):
            pre = u[layer].repeat_interleave(spec.group_size, 0) * 4.0 * math.sqrt(d)
            pre = pre + torch.randn(pre.shape, generator=qg) * 0.3
            out.append(model.rotary.rotate(pre.unsqueeze(1), torch.tensor([rows])))
        return out

    question = []
    for layer in range(layers):
        pre = u[layer].repeat_interleave(spec.group_size, 0).unsqueeze(1) * 4.0 * math.sqrt(d)
        pre = pre + torch.randn(spec.num_heads, 16, d, generator=g) * 0.3
        question.append(model.rotary.rotate(pre, torch.arange(rows - 16, rows)))
    return cache, keys, query, question


def test_kmeans_recovers_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(2, 8, 4, generator=g) * 10
    labels = torch.randint(8, (2, 400), generator=g)
    points = (
        torch.gather(centers, 1, labels.unsqueeze(-1).expand(2, 400, 4)) + torch.randn(2, 400, 4, generator=g) * 0.1
    )
    fitted, assignment = kmeans(points, 8, 20, torch.Generator().manual_seed(1))
    # every fitted centroid sits on a true centre, and points of one true cluster share a code
    distance = torch.cdist(fitted, centers).min(-1).values
    assert float(distance.max()) < 0.5
    for b in range(2):
        for label in range(8):
            assert assignment[b][labels[b] == label].unique().numel() == 1


def copy_cache(cache: KVCache, extra: int = 8) -> KVCache:
    return cache.clone(extra_capacity=extra)


def full_budget_and_dense(model, ids: torch.Tensor, codebook, selector: str, steps: int = 3):
    """(sparse, dense) logits of `steps` greedy decode steps after a prefill of `ids`, the
    sparse side through `selector` at a budget covering every row."""
    from ragkv.sparse import PromptState, SparseConfig

    rows = ids.numel()
    cache = model.new_cache(rows + 8)
    token = int(model.prefill(ids, cache).argmax())
    dense_cache, sparse_cache = cache.clone(4), cache.clone(4)
    attention = SparseConfig(selector=selector, budget=1.0, window=8).build(
        PromptState.from_prefill(model, sparse_cache, ids, 2, rows - 8), codebook
    )
    pairs = []
    for _ in range(steps):
        dense = model.decode_step(token, dense_cache)
        pairs.append((model.decode_step(token, sparse_cache, attention), dense))
        token = int(dense.argmax())
    return pairs
