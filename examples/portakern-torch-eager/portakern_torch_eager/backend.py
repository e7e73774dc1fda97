"""TorchEagerBackend: capabilities as data, on portakern's backend base.

Everything portakern needs from a backend is declared here: a ``name``, the ``array_kind`` its kernels receive,
the device types it runs on, a default ``priority``, the module that must import (``requires``) and the op kind ->
lowering module table (``lowerings``). The base (``portakern.Backend``) turns them into ``status()``,
``supports()`` (with a reason when the answer is no), ``compile()`` and ``prepare_weight()``: it checks the status,
the device type and the ``check`` hook below, then asks the lowering module (``attention.supports`` /
``compile``, ``quant_gemv.compile`` / ``prepare_weight``).
"""

from __future__ import annotations

from portakern import Backend, Device, Support
from portakern.backend import YES, no
from portakern.ir.dtypes import STORAGE_FLOATS


def _torch_version() -> str:
    try:
        import torch

        return f"torch {torch.__version__}"
    except Exception:
        return "torch not installed"


class TorchEagerBackend(Backend):
    name = "torch-eager"
    version = f"0.1.0 ({_torch_version()})"
    array_kind = "torch"             # kernels receive torch tensors on the target device
    device_types = ("cpu", "cuda")
    priority = -20                   # below the built-ins: serves only when asked for by name
    requires = ("torch",)            # status() is "unavailable: ..." without it
    install_hint = "pip install torch"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}   # modules of this package
    device_refusal = ("torch-eager runs on {types} torch devices, not on {type}; pass backend=None to let "
                      "portakern pick a backend for {device}")

    def check(self, op, device: Device) -> Support:
        """Both ops: storage floats only (the lowering modules decide the rest)."""
        if op.dtype not in STORAGE_FLOATS:
            return no(f"dtype {op.dtype.value} is not a storage float (float16, bfloat16, float32)")
        return YES


__all__ = ["TorchEagerBackend"]
