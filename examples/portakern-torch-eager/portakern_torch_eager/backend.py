"""TorchEagerBackend: capabilities (as data) and the op -> lowering table.

Everything portakern needs from a backend is here: a ``name``, the ``array_kind`` its kernels
receive, the device types it runs on, a default ``priority``, ``supports()`` (with a reason when
the answer is no) and ``compile()`` (returns the kernel, called once per call signature).
"""

from __future__ import annotations

from portakern import Backend, Device, Support
from portakern.backend import YES, no
from portakern.ir.dtypes import STORAGE_FLOATS

#: The eager path materialises one (Hq, Sq, Sk) float32 score block per batch entry.
MAX_SCORE_BYTES = 4 << 30


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

    def status(self) -> str:
        try:
            import torch  # noqa: F401
        except Exception as e:
            return f"unavailable: {type(e).__name__}: {e} (pip install torch)"
        return "ok"

    def supports(self, op, device: Device) -> Support:
        st = self.status()
        if st != "ok":
            return no(st)
        if device.type not in self.device_types:
            return no(f"torch-eager runs on {' and '.join(self.device_types)} torch devices, not on "
                      f"{device.type}; pass backend=None to let portakern pick a backend for {device}")
        if op.dtype not in STORAGE_FLOATS:
            return no(f"dtype {op.dtype.value} is not a storage float (float16, bfloat16, float32)")
        if op.kind == "attention":
            score_bytes = 4 * op.heads_q * op.seqlen_q * op.seqlen_k
            if score_bytes > MAX_SCORE_BYTES:
                return no(f"torch-eager materialises the (Hq, Sq, Sk) = ({op.heads_q}, {op.seqlen_q}, "
                          f"{op.seqlen_k}) float32 score block per batch entry, "
                          f"{score_bytes / 2**30:.1f} GiB > {MAX_SCORE_BYTES >> 30} GiB; use a "
                          "flash-style backend (backend=None) or split the batch")
            return YES
        if op.kind == "quant_gemv":
            return YES  # every packing: it dequantizes through QuantizedWeight.dequantize()
        return no(f"op {op.kind!r} has no torch-eager lowering")

    def compile(self, op, device: Device):
        if op.kind == "attention":
            from .attention import attention_kernel

            return attention_kernel(op)
        from .quant_gemv import quant_gemv_kernel

        return quant_gemv_kernel(op)

    def prepare_weight(self, weight, device: Device):
        """Dequantize once to a dense float32 ``(N, K)`` tensor on ``device`` (cached by portakern)."""
        from .quant_gemv import dense_weight

        return dense_weight(weight, device)


__all__ = ["TorchEagerBackend"]
