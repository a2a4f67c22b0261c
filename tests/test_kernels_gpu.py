"""The split-K Triton decode on a real GPU against the torch reference (skipped without
CUDA). The CPU tests run the kernel under Triton's interpreter, which cannot multiply
bfloat16 (it takes the float32 path there); this runs every dtype as compiled, with GQA
groups that pad, head dims that mask, ragged per-head lengths and rows past each request's
length set to 1e4, in a fresh interpreter without TRITON_INTERPRET (conftest sets it)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from ragkv.bench.kernel_bench import relative_error
from ragkv.kernels.dispatch import importable

GEOMETRIES = ((8, 4, 128), (3, 3, 64), (2, 1, 64), (1, 8, 128), (4, 5, 96))  # (Hkv, group, head dim)
SELECTIONS = ((77, 37), (4096, 1), (8192, 492), (30000, 1800))  # (cached rows, rows read)


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def check_on_gpu() -> None:
    from ragkv.kernels import reference, sparse_decode_attention
    from ragkv.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hkv, group, d in GEOMETRIES:
            for t, num_sel in SELECTIONS:
                for ragged in (False, True):
                    q = torch.randn(hkv * group, d, generator=g).to("cuda", dtype)
                    k = (torch.randn(hkv, t, d, generator=g) * 2).to("cuda", dtype)
                    v = torch.randn(hkv, t, d, generator=g).to("cuda", dtype)
                    idx = torch.randint(0, t, (hkv, num_sel), generator=g).cuda()
                    lengths = torch.randint(1, num_sel + 1, (hkv,), generator=g).cuda() if ragged else None
                    scale = 1 / math.sqrt(d)
                    out, lse = sparse_decode_attention(q, k, v, idx, scale, lengths, return_lse=True, backend="triton")
                    ref, ref_lse = reference.sparse_decode_attention(q, k, v, idx, scale, lengths)
                    case = (dtype, hkv, group, d, t, num_sel, ragged)
                    assert relative_error(out, ref) < tolerance(dtype), case
                    assert float((lse - ref_lse).abs().max()) < 1e-3, case
            lengths = [1, 37, 700, 9000]
            q = torch.randn(len(lengths), hkv * group, d, generator=g).to("cuda", dtype)
            keys, values = [], []
            for n in lengths:
                buffer = torch.randn(2, hkv, n + 50, d, generator=g)
                buffer[:, :, n:] = 1e4  # a kernel reading past a request's length would show
                keys.append(buffer[0].to("cuda", dtype))
                values.append(buffer[1].to("cuda", dtype))
            got = decode_attention(q, keys, values, lengths, 0.1, backend="triton")
            expected = reference.decode_attention(q, keys, values, lengths, 0.1)
            assert relative_error(got, expected) < tolerance(dtype), (dtype, hkv, group, d)
    print("gpu checks ok")


@pytest.mark.skipif(not (torch.cuda.is_available() and importable("triton")), reason="needs a CUDA GPU and triton")
def test_split_decode_on_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu checks ok" in result.stdout


if __name__ == "__main__":
    check_on_gpu()
