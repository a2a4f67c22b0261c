"""Glue that maps :mod:`kernels` ops onto FlashInfer kernels (CUDA only).

Modules here import flashinfer lazily, inside the function that runs it, so the
pure-torch layout helpers can be tested on machines without FlashInfer.
"""
