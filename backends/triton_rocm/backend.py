"""TritonRocmBackend: the triton-rocm backend's capabilities, as data on the core's backend base.

The triton backend's kernel bodies on AMD CDNA GPUs (``rocm`` devices of a HIP build of torch), with AMD launch
configurations (``tuning.py``); on a CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter, which ignores the AMD
options), and lowered to hsaco for gfx942 / gfx950 without a device (``compile_targets``). What is its own here:
the interpreter switch (``runtime_status``, ``check``) and the refusal of gfx targets without a table row.
"""

from __future__ import annotations

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.gemv_weight import GEMV_LAYOUT

from . import tuning
from .common.switches import interpreting


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "not installed"


class TritonRocmBackend(Backend):
    """Triton kernels on AMD CDNA GPUs (gfx90a, gfx942, gfx950), and Triton's CPU interpreter under
    ``TRITON_INTERPRET=1``."""

    name = "triton-rocm"
    version = _triton_version()
    array_kind = "torch"
    device_types = ("rocm", "cpu")
    priority = 100
    compile_targets = tuning.COMPILE_TARGETS
    x_prologues = ("silu_mul",)
    weight_layout = GEMV_LAYOUT
    requires = ("torch", "triton")
    install_hint = "pip install 'portakern[triton]' (on a ROCm build of torch for AMD GPUs)"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    device_refusal = ("triton-rocm runs on AMD GPUs (rocm devices of a HIP build of torch), not on {type} "
                      "devices; on NVIDIA GPUs the triton backend runs the same kernels")

    def compile(self, op, device: Device):
        """The lowering's kernel; on a rocm device made to launch on that GPU whatever device is current."""
        kernel = super().compile(op, device)
        if device.type == "rocm":
            from .common.launch import on_device

            kernel = on_device(kernel, device.index)
        return kernel

    def runtime_status(self) -> str:
        return "ok (interpreter)" if interpreting() else "ok"

    def check(self, op, device: Device) -> Support:
        if device.type == "cpu":
            if not interpreting():
                return no("triton-rocm runs on AMD GPUs; on a CPU only under TRITON_INTERPRET=1")
            return YES
        target = (device.arch or "").split(":")[0]
        if target not in tuning.TARGETS or target == "interp":
            known = ", ".join(t for t in tuning.TARGETS if t != "interp")
            return no(f"triton-rocm has launch configurations for {known}, not for {device.arch or 'an unknown '}"
                      f"{'' if device.arch else 'architecture'} ({device}): RDNA and older GCN parts are not "
                      f"tuned; pass backend=\"cpu\" or add a row for it to backends/triton_rocm/tuning.py")
        return YES


__all__ = ["TritonRocmBackend"]
