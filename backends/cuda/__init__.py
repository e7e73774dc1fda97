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
#: rank of the cuda backend for fp16 x on a weight held only as fragments (its fragment kernel runs M = 1 to 4 of
#: fp16 and bf16 x), where no measurement ranks it: triton's fragment kernel is bf16-only, so triton would
#: dequantize the whole weight for each call (``FragmentsDense``), moving several times the bytes of a GEMV kernel
#: that reads the codes once at an M where both are bound by memory
FRAGMENT_FP16_PRIORITY = 105


@hookimpl
def portakern_backend_priority(backend, op, device):
    # above triton only where a GPU sweep of this family measured the problem faster, for the layout the op's weights
    # are prepared in by default (the hook sees the op, not the weight): for weights held only as fragments
    # (quant_gemv.fragments_only), where tuning.FRAG_TABLE has the problem (each entry timed ahead of the triton table
    # in its sweep), and fp16 x (FRAGMENT_FP16_PRIORITY); else where tuning.TABLE (the word kernel) says it won.
    # Attention: tuning.ATTENTION_TABLE, empty, nothing measured, so attention always ranks below triton
    kind = getattr(op, "kind", None)
    if backend.name != CudaBackend.name or device.type != "cuda" or kind not in ("quant_gemv", "attention"):
        return None
    if kind == "attention":
        from .tuning import ATTENTION_TABLE

        family = f"sm_{device.capability[0]}{device.capability[1]}" if device.capability else str(device.arch)
        key = (op.dtype.value, op.head_dim, op.mask_mod is not None)
        return MEASURED_WIN_PRIORITY if (family, *key) in ATTENTION_TABLE else None
    from portakern.ir.dtypes import DType

    from .quant_gemv import frag_table_entry, fragments_only, table_entry

    if fragments_only(op, device):
        if frag_table_entry(op, device.capability, device.name) is not None:
            return MEASURED_WIN_PRIORITY
        return FRAGMENT_FP16_PRIORITY if op.dtype is DType.float16 else None
    entry = table_entry(op, device.capability, device.name)
    return MEASURED_WIN_PRIORITY if entry is not None and entry[5] else None   # entry[5]: beats_triton
