"""TritonBackend: capabilities and the op -> lowering table."""

from __future__ import annotations

import contextlib
import os

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.gemv_weight import GEMV_LAYOUT
from portakern.placement import on_device


#: Compile options every kernel of this backend is launched and lowered with. ``enable_fp_fusion``:
#: the kernels are written for fused multiply-adds (the GEMV's one FFMA per code, the attention's
#: ``acc += p @ v`` rescaling), which Triton 3.6-3.9 emit by default and Triton 3.10 will not
#: (``TRITON_DEFAULT_FP_FUSION``); stating it keeps the compiled code the same across versions.
KERNEL_OPTIONS = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def interpret_env(on: bool):
    """Set ``TRITON_INTERPRET`` to ``on`` for the block (``@triton.jit`` and ``triton.compile``
    read it), restoring the caller's value afterwards."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "not installed"


class TritonBackend(Backend):
    name = "triton"
    version = _triton_version()
    array_kind = "torch"
    device_types = ("cuda", "cpu")
    priority = 100
    compile_targets = ("sm_80", "sm_90a", "sm_100a", "sm_120")
    x_prologues = ("silu_mul",)
    weight_layout = GEMV_LAYOUT

    def status(self) -> str:
        try:
            import torch  # noqa: F401
            import triton  # noqa: F401
        except Exception as e:
            return f"unavailable: {type(e).__name__}: {e} (pip install 'portakern[triton]')"
        return "ok (interpreter)" if interpreting() else "ok"

    def _lowering(self, op):
        if op.kind == "attention":
            from . import attention as mod
        elif op.kind == "quant_gemv":
            from . import quant_gemv as mod
        else:
            return None
        return mod

    def supports(self, op, device: Device) -> Support:
        st = self.status()
        if not st.startswith("ok"):
            return no(st)
        if device.type == "cpu" and not interpreting():
            return no("triton runs on NVIDIA GPUs; on a CPU only under TRITON_INTERPRET=1")
        if device.type not in ("cuda", "cpu"):
            return no(f"triton (NVIDIA) does not run on {device.type} devices")
        if device.type == "cuda" and device.capability and device.capability < (8, 0):
            return no(f"triton kernels need sm_80 or newer; {device} is {device.arch}")
        mod = self._lowering(op)
        if mod is None:
            return no(f"op {op.kind!r} has no triton lowering")
        return mod.supports(op, device)

    def compile(self, op, device: Device):
        return on_device(self._lowering(op).compile(op, device), device)

    def prepare_weight(self, weight, device: Device):
        from portakern.gemv_weight import prepare_gemv_weight, wants_fragments

        # the fragment copy is what this backend's tensor-core kernel reads (kernels/gemv_frag.py)
        return prepare_gemv_weight(weight, device, fragments=wants_fragments(device))

    def compile_for_target(self, op, target: str):
        return self._lowering(op).compile_for_target(op, target)


__all__ = ["TritonBackend", "YES", "interpret_env", "interpreting", "on_device"]
