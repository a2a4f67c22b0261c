"""sparse_decode_attention: Triton vs torch reference, dense equivalence, FlashInfer layout."""

import math

import pytest
import torch
import torch.nn.functional as F

from ragkv.kernels import BackendUnavailableError, reference, sparse_decode_attention
from ragkv.kernels.dispatch import importable

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    # The interpreter rounds float32 -> bfloat16 toward zero, torch to nearest: 1 ulp apart.
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
LSE_TOL = dict(atol=1e-4, rtol=1e-5)


def make_inputs(hkv, group, t, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * group, d, generator=g).to(dtype)
    k = torch.randn(hkv, t, d, generator=g).to(dtype)
    v = torch.randn(hkv, t, d, generator=g).to(dtype)
    return q, k, v, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_sel", [1, 37])  # 37: not a multiple of any block size
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("hkv,group", [(2, 1), (2, 3)])
def test_triton_matches_reference(hkv, group, ragged, num_sel, d, dtype):
    t = 77
    q, k, v, g = make_inputs(hkv, group, t, d, dtype, seed=hkv * group * 1000 + num_sel + d)
    indices = torch.randint(0, t, (hkv, num_sel), generator=g)
    lengths = torch.randint(1, num_sel + 1, (hkv,), generator=g) if ragged else None
    scale = 1.0 / math.sqrt(d)
    out, lse = sparse_decode_attention(q, k, v, indices, scale, lengths, return_lse=True, backend="triton")
    ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, scale, lengths)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hkv * group,)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("lengths", [[5], [64], [65], [200]])
def test_triton_splits_merge_exactly(lengths):
    """One head's 200 rows cut into splits of 64: a length ending inside, at or past the
    first split leaves later splits empty, which the merge must ignore."""
    q, k, v, g = make_inputs(1, 4, 300, 64, torch.float32, seed=sum(lengths))
    indices = torch.randperm(300, generator=g)[:200].unsqueeze(0)
    lengths = torch.tensor(lengths)
    out, lse = sparse_decode_attention(q, k, v, indices, 0.125, lengths, return_lse=True, backend="triton")
    ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, 0.125, lengths)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("hkv,group", [(2, 1), (1, 3)])
def test_all_rows_equals_dense_sdpa(hkv, group, backend):
    t, d = 45, 64
    q, k, v, _ = make_inputs(hkv, group, t, d, torch.float32, seed=3)
    scale = 0.3  # not 1/sqrt(d), so a dropped scale would show
    indices = torch.arange(t).expand(hkv, t)
    out, lse = sparse_decode_attention(q, k, v, indices, scale, return_lse=True, backend=backend)
    dense = F.scaled_dot_product_attention(q.unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    logits = torch.einsum("hd,htd->ht", q, k.repeat_interleave(group, dim=0)) * scale
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lengths_ignore_padding(backend):
    """Padding past lengths[h] points at a row that would dominate the softmax if read."""
    hkv, group, t, d = 2, 3, 40, 64
    q, k, v, g = make_inputs(hkv, group, t, d, torch.float32, seed=5)
    k[:, 0] = q.view(hkv, group, d).sum(1) * 10  # row 0 aligns with every query head
    v[:, 0] = 100.0
    lengths = torch.tensor([5, 12])
    indices = torch.zeros(hkv, 16, dtype=torch.int64)
    for h, n in enumerate(lengths.tolist()):
        indices[h, :n] = torch.randperm(t - 1, generator=g)[:n] + 1
    out = sparse_decode_attention(q, k, v, indices, 0.125, lengths, backend=backend)
    for h, n in enumerate(lengths.tolist()):
        heads = slice(h * group, (h + 1) * group)
        alone = sparse_decode_attention(
            q[heads], k[h : h + 1], v[h : h + 1], indices[h : h + 1, :n], 0.125, backend=backend
        )
        torch.testing.assert_close(out[heads], alone, atol=1e-5, rtol=1e-5)
    assert out.abs().max() < 10


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_row_order_does_not_matter(backend):
    hkv, group, t, d = 2, 3, 60, 128
    q, k, v, g = make_inputs(hkv, group, t, d, torch.float32, seed=8)
    indices = torch.stack([torch.randperm(t, generator=g)[:33] for _ in range(hkv)])
    shuffled = indices[:, torch.randperm(33, generator=g)]
    a, lse_a = sparse_decode_attention(q, k, v, indices, 0.1, return_lse=True, backend=backend)
    b, lse_b = sparse_decode_attention(q, k, v, shuffled, 0.1, return_lse=True, backend=backend)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_a, lse_b, atol=1e-5, rtol=1e-5)


class FakeDecodeWrapper:
    """Stands in for flashinfer.BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode, with
    the same buffer contract: plan() copies the page table into the fixed buffers given at
    construction, run() reads the pages those buffers name (torch, on any device)."""

    instances: list["FakeDecodeWrapper"] = []

    def __init__(
        self,
        workspace,
        layout,
        *,
        use_cuda_graph,
        paged_kv_indptr_buffer,
        paged_kv_indices_buffer,
        paged_kv_last_page_len_buffer,
    ):
        assert layout == "NHD" and use_cuda_graph
        self.indptr, self.indices, self.last = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        self.plans, self.run_pages = [], []
        FakeDecodeWrapper.instances.append(self)

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode,
        q_data_type,
        kv_data_type,
        sm_scale,
    ):
        assert (num_kv_heads, page_size, pos_encoding_mode) == (1, 1, "NONE")
        assert indices.numel() <= self.indices.numel(), "page table larger than the fixed buffer"
        self.indptr.copy_(indptr)
        self.indices[: indices.numel()].copy_(indices)
        self.last.copy_(last_page_len)
        self.plans.append((num_qo_heads, head_dim, q_data_type, kv_data_type, sm_scale))
        self.scale = sm_scale

    def run(self, q, paged_kv_cache, return_lse):
        k_pages, v_pages = paged_kv_cache
        self.run_pages.append((k_pages, v_pages))
        outs, lses = [], []
        for request in range(q.shape[0]):
            pages = self.indices[self.indptr[request] : self.indptr[request + 1]].long()
            k, v = k_pages[pages, 0, 0].float(), v_pages[pages, 0, 0].float()
            logits = q[request].float() @ k.T * self.scale
            lse = torch.logsumexp(logits, -1)
            outs.append((logits - lse[:, None]).exp() @ v)
            lses.append(lse / math.log(2.0))  # FlashInfer reports base 2
        return torch.stack(outs).to(q.dtype), torch.stack(lses)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    import sys
    import types

    from ragkv.kernels.flashinfer import sparse_attention as glue

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(glue, "_planned", {})
    monkeypatch.setattr(glue, "_WORKSPACE_BYTES", 16)
    FakeDecodeWrapper.instances.clear()
    return glue


@pytest.mark.parametrize("ragged", [False, True])
def test_flashinfer_page_table_addresses_selected_rows(ragged):
    """Pages are rows of the cache buffer itself: indices[h, :lengths[h]] of head h, no copy."""
    from ragkv.kernels.flashinfer.sparse_attention import page_indices, paged_view

    hkv, t, capacity, d = 3, 20, 32, 8
    buffer = torch.randn(2, hkv, capacity, d, generator=torch.Generator().manual_seed(9))
    k = buffer[1, :, :t]  # one layer's valid rows, the way decode reads them
    indices = torch.randint(0, t, (hkv, 7), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([7, 2, 5]) if ragged else None
    pages, rows_per_head = paged_view(k)
    assert rows_per_head == capacity and pages.shape == ((hkv - 1) * capacity + t, 1, 1, d)
    assert (
        pages.data_ptr() == k.data_ptr() and pages.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )
    kv_indices = page_indices(indices, rows_per_head, lengths)
    assert kv_indices.dtype == torch.int32
    offset = 0
    for h in range(hkv):
        n = 7 if lengths is None else int(lengths[h])
        assert torch.equal(pages[kv_indices[offset : offset + n].long(), 0, 0], k[h, indices[h, :n]])
        offset += n
    assert offset == kv_indices.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_glue_plans_once_per_step_and_reads_the_cache_in_place(fake_flashinfer, dtype):
    """A decode step's layers share one plan; each layer reads its own rows, in place."""
    layers, hkv, group, t, capacity, d = 4, 2, 3, 40, 48, 64
    g = torch.Generator().manual_seed(12)
    keys = torch.randn(layers, hkv, capacity, d, generator=g).to(dtype)
    values = torch.randn(layers, hkv, capacity, d, generator=g).to(dtype)
    for step in range(2):
        num_sel = 9 + step  # the budget grows with the cache: a new plan
        for layer in range(layers):
            q = torch.randn(hkv * group, d, generator=g).to(dtype)
            indices = torch.stack([torch.randperm(t, generator=g)[:num_sel] for _ in range(hkv)])
            k, v = keys[layer, :, :t], values[layer, :, :t]
            out, lse = fake_flashinfer.sparse_decode_flashinfer(q, k, v, indices, 0.125, None)
            ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, 0.125, None)
            torch.testing.assert_close(out, ref_out, **TOL[dtype])
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
            k_pages, v_pages = FakeDecodeWrapper.instances[-1].run_pages[-1]
            assert k_pages.data_ptr() == k.data_ptr() and v_pages.data_ptr() == v.data_ptr()
    plans = [plan for wrapper in FakeDecodeWrapper.instances for plan in wrapper.plans]
    assert len(plans) == 2 and plans[0] == (group, d, dtype, dtype, 0.125)


def test_flashinfer_glue_ragged_lengths_plan_each_call(fake_flashinfer):
    hkv, group, t, d = 3, 2, 30, 64
    q, k, v, g = make_inputs(hkv, group, t, d, torch.float16, seed=13)
    indices = torch.randint(0, t, (hkv, 8), generator=g)
    for lengths in (torch.tensor([8, 3, 5]), torch.tensor([1, 8, 2])):
        out, lse = fake_flashinfer.sparse_decode_flashinfer(q, k, v, indices, 0.2, lengths)
        ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, 0.2, lengths)
        torch.testing.assert_close(out, ref_out, **TOL[torch.float16])
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert sum(len(wrapper.plans) for wrapper in FakeDecodeWrapper.instances) == 2


@pytest.mark.skipif(not (torch.cuda.is_available() and importable("flashinfer")), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_reference(dtype):
    hkv, group, t, d = 2, 3, 300, 128
    q, k, v, g = make_inputs(hkv, group, t, d, dtype, seed=10)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    indices = torch.randint(0, t, (hkv, 64), generator=g).cuda()
    lengths = torch.tensor([64, 17]).cuda()
    out, lse = sparse_decode_attention(q, k, v, indices, 0.09, lengths, return_lse=True, backend="flashinfer")
    ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, 0.09, lengths)
    torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-3)


def test_backend_errors():
    q, k, v, _ = make_inputs(1, 2, 10, 64, torch.float32, seed=0)
    indices = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(BackendUnavailableError, match="no flashinfer backend for these inputs"):
        sparse_decode_attention(q, k, v, indices, 0.1, backend="flashinfer")  # float32
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        sparse_decode_attention(q.half(), k.half(), v.half(), indices, 0.1, backend="flashinfer")


def test_rejects_bad_arguments():
    q, k, v, _ = make_inputs(2, 2, 10, 64, torch.float32, seed=0)
    indices = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple"):
        sparse_decode_attention(q[:3], k, v, indices, 0.1)
    with pytest.raises(ValueError, match="indices"):
        sparse_decode_attention(q, k, v, indices[:1], 0.1)
    with pytest.raises(ValueError, match="share a dtype"):
        sparse_decode_attention(q, k.half(), v, indices, 0.1)
    with pytest.raises(ValueError, match="lengths"):
        sparse_decode_attention(q, k, v, indices, 0.1, lengths=torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="v_cache"):
        sparse_decode_attention(q, k, v[:, :5], indices, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("capacity", [50, 64])  # 64: a layer view into a buffer with spare rows
def test_cpu_path_matches_reference(dtype, ragged, capacity):
    """The CPU torch path (flat row lookups into the cache buffer) against the reference,
    on a cache layer that is a strided view, the way decode reads it."""
    hkv, group, t, d = 3, 3, 50, 64
    g = torch.Generator().manual_seed(11)
    buffer = torch.randn(2, hkv, capacity, d, generator=g).to(dtype)
    k, v = buffer[1, :, :t], buffer[0, :, :t]
    q = torch.randn(hkv * group, d, generator=g).to(dtype)
    indices = torch.randint(0, t, (hkv, 20), generator=g)
    lengths = torch.tensor([3, 20, 11]) if ragged else None
    out, lse = sparse_decode_attention(q, k, v, indices, 0.125, lengths, return_lse=True, backend="torch")
    ref_out, ref_lse = reference.sparse_decode_attention(q, k, v, indices, 0.125, lengths)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    alone = sparse_decode_attention(q, k, v, indices, 0.125, lengths, backend="torch")  # the path without lse
    torch.testing.assert_close(alone, ref_out, **TOL[dtype])
