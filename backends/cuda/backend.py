"""CudaBackend: capabilities and the op -> lowering table."""

from __future__ import annotations

from portakern.backend import Backend, Support, no
from portakern.devices import Device
from portakern.gemv_weight import GEMV_LAYOUT
from portakern.placement import on_device


def _version() -> str:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        return f"cuda-bindings, NVRTC {major}.{minor}"
    except Exception:
        return "cuda-bindings not installed"


class CudaBackend(Backend):
    """CUDA C kernels compiled at run time by NVRTC, for NVIDIA GPUs (sm_80 and newer).

    So far one op: ``quant_gemv`` at M = 1 to 4 (``quant_gemv.py``), on the triton backend's weight layout. It ranks
    below triton (90) except for the problems its measured table (``gemv_table``) says it runs faster, where its
    priority hook ranks it at 110; elsewhere it serves when asked by name (``backend="cuda"``) or when
    ``use_policy("fastest")`` measures it ahead.
    """

    name = "cuda"
    version = _version()
    array_kind = "torch"
    device_types = ("cuda",)
    priority = 90
    compile_targets = ("sm_80", "sm_90a", "sm_100a", "sm_120")
    #: prepared weights are shared with the triton backend (the same layout, one copy on the device)
    weight_layout = GEMV_LAYOUT

    def status(self) -> str:
        try:
            import torch  # noqa: F401
        except Exception as e:
            return f"unavailable: {type(e).__name__}: {e} (pip install 'portakern[cuda]')"
        from .nvrtc import unavailable

        why = unavailable()
        return f"unavailable: {why}" if why else "ok"

    def _lowering(self, op):
        if op.kind == "quant_gemv":
            from . import quant_gemv as mod

            return mod
        return None

    def supports(self, op, device: Device) -> Support:
        st = self.status()
        if st != "ok":
            return no(st)
        if device.type != "cuda":
            return no(f"the cuda backend runs on NVIDIA GPUs (torch CUDA tensors), not on {device.type} devices")
        if device.capability and device.capability < (8, 0):
            return no(f"the cuda backend's kernels need sm_80 or newer; {device} is {device.arch}")
        mod = self._lowering(op)
        if mod is None:
            return no(f"op {op.kind!r} has no cuda lowering yet (use the triton backend)")
        return mod.supports(op, device)

    def compile(self, op, device: Device):
        return on_device(self._lowering(op).compile(op, device), device)

    def prepare_weight(self, weight, device: Device):
        from portakern.gemv_weight import prepare_gemv_weight, wants_fragments

        # one copy per weight and device serves every backend of the layout: the same one triton builds
        return prepare_gemv_weight(weight, device, fragments=wants_fragments(device))

    def compile_for_target(self, op, target: str):
        return self._lowering(op).compile_for_target(op, target)


__all__ = ["CudaBackend"]
