"""Gluon names that differ between the Triton versions the backend runs on (3.6 on the lent H200, 3.9 in CI)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

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


if hasattr(tma, "async_load"):       # Triton 3.9 (3.6's name below was removed there)
    @gluon.jit
    def tma_load(desc, coord, bar, dst):
        """A TMA copy of ``desc``'s block at ``coord`` (a tuple) into ``dst``, completing on ``bar``."""
        tma.async_load(desc, coord, bar, dst)
else:                                # Triton 3.6
    @gluon.jit
    def tma_load(desc, coord, bar, dst):
        """A TMA copy of ``desc``'s block at ``coord`` (a tuple) into ``dst``, completing on ``bar``."""
        tma.async_copy_global_to_shared(desc, coord, bar, dst)


@gluon.jit
def launch_dependents():
    """(sm_90+) Let the next kernel in the stream, if launched as a programmatic dependent, launch now (once
    every program of this grid has said so or exited); it still waits for this grid's completion itself."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def wait_for_producer(PDL: gl.constexpr):
    """PDL (the kernel launched as a programmatic dependent, sm_90+): wait until the previous kernel in the
    stream has completed and its writes are visible, then let the next one launch (it waits for this one's
    completion itself before reading what this one writes). Reads before this must be of constants only."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        launch_dependents()

