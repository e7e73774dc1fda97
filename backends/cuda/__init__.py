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
    # above triton only where a GPU sweep of this family measured the problem faster (tuning.TABLE for the GEMV,
    # tuning.ATTENTION_TABLE for attention: empty, nothing measured, so attention always ranks below triton)
    kind = getattr(op, "kind", None)
    if backend.name != CudaBackend.name or device.type != "cuda" or kind not in ("quant_gemv", "attention"):
        return None
    if kind == "attention":
        from .tuning import ATTENTION_TABLE

        family = f"sm_{device.capability[0]}{device.capability[1]}" if device.capability else str(device.arch)
        key = (op.dtype.value, op.head_dim, op.mask_mod is not None)
        return MEASURED_WIN_PRIORITY if (family, *key) in ATTENTION_TABLE else None
    from .quant_gemv import table_entry

    entry = table_entry(op, device.capability, device.name)
    return MEASURED_WIN_PRIORITY if entry is not None and entry[5] else None   # entry[5]: beats_triton
