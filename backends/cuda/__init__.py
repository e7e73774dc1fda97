"""The ``cuda`` backend: CUDA C kernels for NVIDIA GPUs (sm_80 and newer), compiled at run time by NVRTC and
launched through the driver API (``cuda-bindings``). Registered through the ``portakern.backends`` entry point
like any third-party plugin."""

from portakern.plugins import hookimpl

from .backend import CudaBackend


@hookimpl
def portakern_register_backends():
    return [CudaBackend()]
