"""The ``cuda`` backend: CUDA C kernels for NVIDIA GPUs (sm_80 and newer), compiled at run time by NVRTC and
launched through the driver API (``cuda-bindings``). Registered through the ``portakern.backends`` entry point
like any third-party plugin."""

from portakern.plugins import hookimpl

from .backend import CudaBackend


@hookimpl
def portakern_register_backends():
    return [CudaBackend()]


#: rank of the cuda backend for problems its measured table says it runs faster than triton (triton: 100)
MEASURED_WIN_PRIORITY = 110


@hookimpl
def portakern_backend_priority(backend, op, device):
    # above triton only where a GPU sweep of this family measured the problem faster (tuning.TABLE)
    if backend.name != CudaBackend.name or getattr(op, "kind", None) != "quant_gemv" or device.type != "cuda":
        return None
    from .quant_gemv import table_entry

    entry = table_entry(op, device.capability, device.name)
    return MEASURED_WIN_PRIORITY if entry is not None and entry[5] else None   # entry[5]: beats_triton
