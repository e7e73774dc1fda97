"""Gluon names that differ between the Triton versions the backend runs on (3.6 on the lent H200, 3.9 in CI)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

if hasattr(gl, "thread_barrier"):    # Triton 3.6
    @gluon.jit
    def cta_barrier():
        """A barrier of the calling warps (the CTA, or a ``warp_specialize`` partition)."""
        gl.thread_barrier()
else:                                # Triton 3.9 renamed it
    @gluon.jit
    def cta_barrier():
        """A barrier of the calling warps (the CTA, or a ``warp_specialize`` partition)."""
        gl.barrier()
