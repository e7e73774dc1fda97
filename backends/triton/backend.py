"""TritonBackend: the triton backend's capabilities, as data on the core's backend base.

The shared checks (status, device type, the sm_80 floor, a lowering for the op) and compile (each kernel made
current-device safe with ``portakern.placement.on_device``) are ``portakern.backend.Backend``'s; what is this
backend's own is the interpreter: on a CPU it runs only under ``TRITON_INTERPRET=1`` (``runtime_status``,
``check``). The lowerings are the ``attention`` and ``quant_gemv`` packages beside this module.
"""

from __future__ import annotations

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.gemv_weight import GEMV_LAYOUT

from .common.switches import interpreting


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "not installed"


class TritonBackend(Backend):
    """Triton kernels for NVIDIA GPUs (sm_80 and newer), and Triton's CPU interpreter under ``TRITON_INTERPRET=1``."""

    name = "triton"
    version = _triton_version()
    array_kind = "torch"
    device_types = ("cuda", "cpu")
    priority = 100
    compile_targets = ("sm_80", "sm_90a", "sm_100a", "sm_120")
    x_prologues = ("silu_mul",)
    weight_layout = GEMV_LAYOUT
    requires = ("torch", "triton")
    install_hint = "pip install 'portakern[triton]'"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    min_capability = (8, 0)
    device_refusal = ("triton (NVIDIA) does not run on {type} devices; on AMD GPUs (rocm) the triton-rocm backend "
                      "runs the same kernels: backend=\"triton-rocm\"")
    launches_on_current_device = True
    runtime_lengths = True  # its attention kernels read the sequence lengths from each call (attention.runtime)

    def runtime_status(self) -> str:
        return "ok (interpreter)" if interpreting() else "ok"

    def check(self, op, device: Device) -> Support:
        if device.type == "cpu" and not interpreting():
            return no("triton runs on NVIDIA GPUs; on a CPU only under TRITON_INTERPRET=1")
        return YES


__all__ = ["TritonBackend"]
