"""OpenCLBackend: capabilities as data on the core's backend base, plus what is the opencl backend's own (the
platform check, the bfloat16 rule for OpenCL arrays, a version read lazily)."""

from __future__ import annotations

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.ir.dtypes import DType


def _version() -> str:
    try:
        import pyopencl as cl
    except Exception:
        return "pyopencl not installed"
    from portakern.opencl_runtime import cl_devices

    platforms = sorted({" ".join(f"{dict(d.info)['platform']} {c.platform.version}".split()) for d, c in cl_devices()})
    return f"pyopencl {cl.VERSION_TEXT}" + (f"; {', '.join(platforms)}" if platforms else "; no OpenCL platform")


class _LazyVersion:
    """``OpenCLBackend.version``, computed on first read: listing the OpenCL platforms starts the drivers (PoCL
    loads LLVM, which installs its crash signal handlers), which a process that never uses OpenCL should not pay
    for at plugin registration."""

    def __get__(self, obj, cls) -> str:
        value = cls.__dict__.get("_version_text")
        if value is None:
            value = _version()
            cls._version_text = value
        return value


class OpenCLBackend(Backend):
    """OpenCL C kernels for any OpenCL 1.2 device (CI: PoCL on the CPU).

    Runs on pyopencl arrays (on their queue's device) and, when asked by name (``backend="opencl"``), on host
    numpy / CPU torch arrays, which are copied to ``PORTAKERN_OPENCL_DEVICE`` (default opencl:0) and back; for
    host arrays it ranks below the cpu reference (see ``portakern_backend_priority`` in ``__init__``).
    bfloat16 inputs from torch travel as float32 (exact) and the result is rounded back to bfloat16.
    The weight is repacked once by ``quant_gemv.prepare_weight`` (the base finds it there).
    """

    name = "opencl"
    version = _LazyVersion()
    array_kind = "pyopencl"
    device_types = ("opencl", "cpu")
    priority = 50
    x_prologues = ("silu_mul",)
    requires = ("pyopencl",)
    install_hint = "pip install 'portakern[opencl]'"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    runtime_lengths = True  # its attention kernel takes the sequence lengths as arguments (attention.compile)
    device_refusal = ("the opencl backend runs on OpenCL devices (and host arrays copied to one), not on {type} "
                      "devices; pass pyopencl arrays, or numpy arrays with backend='opencl'")

    def runtime_status(self) -> str:
        """"ok" when pyopencl finds an OpenCL device, else why not and how to get one."""
        from portakern.opencl_runtime import devices

        if not devices():
            return ("unavailable: pyopencl finds no OpenCL platform or device (install a driver; for the CPU "
                    "pip install pocl-binary-distribution, part of 'portakern[opencl]')")
        return "ok"

    def check(self, op, device: Device) -> Support:
        """bfloat16 only from host arrays: pyopencl arrays have no bfloat16 dtype."""
        if device.type == "opencl" and DType.parse(op.dtype) is DType.bfloat16:
            return no("dtype=bfloat16 on an OpenCL device: pyopencl arrays have no bfloat16 dtype; pass CPU torch "
                      "bfloat16 tensors with backend='opencl' (carried to the device as float32, the result "
                      "rounded back to bfloat16), or float16 / float32 pyopencl arrays")
        return YES


__all__ = ["OpenCLBackend"]
