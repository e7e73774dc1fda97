"""The ``triton-rocm`` backend: the triton backend's Triton kernel bodies on AMD CDNA GPUs (gfx90a, gfx942,
gfx950), with AMD launch configurations; under ``TRITON_INTERPRET=1`` also on CPU torch tensors (Triton's
interpreter), ranked below the CPU reference there so it only serves when asked for by name.

Registered through the ``portakern.backends`` entry point like any plugin. It imports nothing of another backend
but ``portakern.backends.triton.kernels`` (the kernel bodies; ``kernels/`` here says which).
"""

from portakern.plugins import hookimpl

from .backend import TritonRocmBackend


@hookimpl
def portakern_register_backends():
    return [TritonRocmBackend()]


@hookimpl
def portakern_backend_priority(backend, op, device):
    # the interpreter is a correctness tool, never the fastest choice on a CPU
    if backend.name == TritonRocmBackend.name and device.type == "cpu":
        return -10
    return None
