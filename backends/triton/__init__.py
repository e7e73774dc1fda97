"""The ``triton`` backend: Triton kernels for NVIDIA GPUs (sm_80 and newer).

Registered through the ``portakern.backends`` entry point like any third-party plugin. Under
``TRITON_INTERPRET=1`` it also runs on CPU torch tensors (Triton's interpreter), ranked below
the CPU reference so it only serves when asked for by name.
"""

from portakern.plugins import hookimpl

from .backend import TritonBackend


@hookimpl
def portakern_register_backends():
    return [TritonBackend()]


@hookimpl
def portakern_backend_priority(backend, op, device):
    # The interpreter is a correctness tool, never the fastest choice on a CPU.
    if backend.name == TritonBackend.name and device.type == "cpu":
        return -10
    return None
