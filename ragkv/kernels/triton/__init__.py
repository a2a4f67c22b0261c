"""``@triton.jit`` kernel bodies, one module per op.

Importing anything here requires triton. The launchers in :mod:`kernels` import
these modules lazily, at the first Triton dispatch, so the package imports without
triton and ``TRITON_INTERPRET`` (read by ``triton.jit`` when a kernel is defined)
may be set any time before the first Triton call.
"""
