"""CpuBackend: capabilities and the op -> lowering table."""

from __future__ import annotations

import numpy as np

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device


class CpuBackend(Backend):
    name = "cpu"
    version = f"numpy {np.__version__}"
    array_kind = "numpy"
    device_types = ("cpu",)
    priority = 0
    x_prologues = ("silu_mul",)

    def supports(self, op, device: Device) -> Support:
        if device.type != "cpu":
            return no(f"the cpu reference backend runs on the host only, not on {device}; "
                      "move the arrays to the CPU or pass backend=None to pick a device backend")
        if op.kind not in ("attention", "quant_gemv"):
            return no(f"op {op.kind!r} has no cpu lowering")
        return YES

    def compile(self, op, device: Device):
        if op.kind == "attention":
            from .attention import attention_kernel

            return attention_kernel(op)
        from .quant_gemv import quant_gemv_kernel

        return quant_gemv_kernel(op)
