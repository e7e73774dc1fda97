"""CudaBackend: capabilities as data on the core's backend base, plus what is the cuda backend's own (NVRTC's
presence, the prepared weight of the shared GEMV layout)."""

from __future__ import annotations

from portakern.backend import Backend
from portakern.devices import Device
from portakern.gemv_weight import GEMV_LAYOUT, prepare_gemv_weight


def _version() -> str:
    """cuda-bindings and the NVRTC version; else which of the two is missing (``runtime_status`` says why)."""
    try:
        from cuda.bindings import nvrtc
    except Exception:
        return "cuda-bindings not installed"
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception:
        return "cuda-bindings, NVRTC library not loadable"
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"cuda-bindings, NVRTC unusable ({err})"
    return f"cuda-bindings, NVRTC {major}.{minor}"


def _dsl_version() -> str:
    """The CuTe DSL the attention kernel is lowered with, or that it is missing."""
    from .common.cute_dsl import version

    return f"CuTe DSL {version()}" if version() else "no CuTe DSL"


class CudaBackend(Backend):
    """CUDA C kernels compiled at run time by NVRTC, for NVIDIA GPUs (sm_80 and newer).

    One op so far: ``quant_gemv`` at M = 1 to 4 (``quant_gemv.py``), on the GEMV weight layout it shares with the
    triton backend (``portakern.gemv_weight``): a kernel that reads its words and one that reads its fragment layout,
    for a weight prepared without words. It ranks below triton (90) except for the problems its measured tables
    (``tuning.FRAG_TABLE`` for weights held only as fragments, the default on CUDA; ``tuning.TABLE`` for words) say
    it runs faster, where its priority hook ranks it at 110, and fp16 x on fragments-only weights (105: triton's
    fragment kernel is bf16-only, ``__init__.py`` says why); elsewhere it serves when asked
    by name (``backend="cuda"``) or when ``use_policy("fastest")`` measures it ahead. Attention is a CuTe DSL kernel
    for Hopper (``attention.py``; correct on an H100, slower than triton), so it never ranks above triton
    (``tuning.ATTENTION_TABLE`` is empty) and serves only when asked by name; its Blackwell sm_100a kernel is
    compiled without a GPU and never served (no Blackwell GPU has run it).
    """

    name = "cuda"
    version = f"{_version()}, {_dsl_version()}"
    array_kind = "torch"
    device_types = ("cuda",)
    priority = 90
    compile_targets = ("sm_80", "sm_90a", "sm_100a", "sm_120")
    #: prepared weights are shared with the triton backend (the same layout, one copy on the device)
    weight_layout = GEMV_LAYOUT
    requires = ("torch",)
    install_hint = "pip install 'portakern[cuda]'"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    min_capability = (8, 0)
    device_refusal = "the cuda backend runs on NVIDIA GPUs (torch CUDA tensors), not on {type} devices"
    launches_on_current_device = True       # the driver API launches on the current context's device

    def runtime_status(self) -> str:
        """"ok" when NVRTC loads (cuda-bindings and the NVRTC library), else why not."""
        from .common.nvrtc import unavailable

        why = unavailable()
        return f"unavailable: {why}" if why else "ok"

    def prepare_weight(self, weight, device: Device):
        """The weight in the shared GEMV layout: one copy per weight and device serves every backend of the layout
        (the same one triton builds)."""
        return prepare_gemv_weight(weight, device)


__all__ = ["CudaBackend"]
