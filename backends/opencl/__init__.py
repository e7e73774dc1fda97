"""The ``opencl`` backend: OpenCL C kernels for any OpenCL 1.2 device (CI runs them on PoCL, on the CPU).

Registered through the ``portakern.backends`` entry point like any third-party plugin. On OpenCL devices
(pyopencl arrays) it ranks between the cpu reference and triton; on host arrays it ranks below the cpu
reference, so numpy calls keep the float64 reference unless ``backend="opencl"`` asks for it.
"""

from portakern.plugins import hookimpl

from .backend import OpenCLBackend


@hookimpl
def portakern_register_backends():
    return [OpenCLBackend()]


@hookimpl
def portakern_backend_priority(backend, op, device):
    # host arrays: the copy to the OpenCL device and back is the caller's choice, never the default
    if backend.name == OpenCLBackend.name and device.type == "cpu":
        return -5
    return None
