"""Every Triton kernel lowers to an sm_90 cubin (no GPU needed).

The CPU interpreter executes kernels as numpy and skips Triton's type checking and
lowering, so a kernel can pass every interpreted test yet fail to compile for a GPU.
This compiles each kernel ahead-of-time for an H100 target in a fresh interpreter
(without TRITON_INTERPRET, so the kernels are real JIT functions).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragkv.kernels.dispatch import importable

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ragkv.kernels.triton.code_scores import code_scores_kernel
from ragkv.kernels.triton.rope import rope_kernel
from ragkv.kernels.triton.selective_attention import selective_attention_kernel
from ragkv.kernels.triton.sparse_attention import decode_split_kernel, merge_splits_kernel

def compile_for_h100(fn, pointer_types, constexprs):
    # Unlisted runtime arguments are sizes/strides (i32); scales are fp32.
    signature = {
        name: "constexpr" if name in constexprs else pointer_types.get(name, "fp32" if "scale" in name else "i32")
        for name in fn.arg_names
    }
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]

for dt in ("fp32", "fp16", "bf16"):
    compile_for_h100(rope_kernel, {"x_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "out_ptr": f"*{dt}"},
                     {"BLOCK_T": 32, "BLOCK_HALF": 64})
    attn = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
    for has_indices in (True, False):
        use_dot = dt != "fp32"
        compile_for_h100(decode_split_kernel,
                         {**attn, "idx_ptr": "*i64", "len_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
                         {"HAS_INDICES": has_indices, "HAS_LENGTHS": dt == "fp16", "USE_DOT": use_dot,
                          "GROUP_PAD": 16 if use_dot else 4, "BLOCK_N": 64 if use_dot else 8, "BLOCK_D": 128})
    compile_for_h100(merge_splits_kernel,
                     {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dt}", "lse_ptr": "*fp32"},
                     {"GROUP_PAD": 16 if dt != "fp32" else 4, "BLOCK_D": 128})
    compile_for_h100(selective_attention_kernel, {**attn, "pos_ptr": "*i32"},
                     {"DOT_PRECISION": "ieee" if dt == "fp32" else "tf32", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 128})
for codes in ("i16", "i32"):
    compile_for_h100(code_scores_kernel, {"table_ptr": "*fp32", "codes_ptr": f"*{codes}", "valid_ptr": "*u8", "out_ptr": "*fp32"},
                     {"HAS_MASK": codes == "i16", "BLOCK_T": 256})
print("ok")
"""


@pytest.mark.skipif(not importable("triton"), reason="needs triton")
def test_kernels_compile_for_sm90(tmp_path):
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-4000:]
