"""Attention-side kernels for ragkv: tensors in, tensors out, no model code.

Every op has a torch reference (:mod:`kernels.reference`); most have a Triton
kernel, sparse decode also a FlashInfer path, and dense batched decode attention a
compiled CPU kernel (``cpu/``, built by :mod:`kernels.cpu_extension`); selective
attention also runs on torch's CPU flash kernel (:mod:`kernels.cpu_flash`) and on a compiled
AVX512-BF16 flash loop (:mod:`kernels.bf16_flash`). Each launcher takes
``backend="auto"|"torch"|"triton"|"flashinfer"|"bf16_flash"|"cpu_flash"|"cpp"``; see
:mod:`kernels.dispatch` for how "auto" chooses. triton and flashinfer are optional
imports.
"""

from ragkv.kernels.code_scores import code_score_topk
from ragkv.kernels.decode_attention import decode_attention
from ragkv.kernels.dispatch import BackendUnavailableError
from ragkv.kernels.rope import apply_rope
from ragkv.kernels.selective_attention import selective_attention
from ragkv.kernels.sparse_attention import sparse_decode_attention

__all__ = [
    "BackendUnavailableError",
    "apply_rope",
    "code_score_topk",
    "decode_attention",
    "selective_attention",
    "sparse_decode_attention",
]
