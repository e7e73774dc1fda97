"""``QuantizedWeight``: a quantized ``W (N, K)`` as data (format + packed tensors)."""

from __future__ import annotations

from typing import Any

from portakern.ir.quant import QuantFormat


class QuantizedWeight:
    """A weight ``W (N, K)`` stored in a ``QuantFormat``; ``tensors`` holds the packed arrays.

    The tensor names and byte layouts per packing are documented on ``portakern.ir.Packing``.
    Arrays may be numpy, torch or cupy; they all live on one device. Backends may repack the
    weight once (``Backend.prepare_weight``); the result is cached in ``prepared`` keyed by
    ``(backend name, device)`` so repeated calls do no repacking.
    """

    def __init__(self, fmt: QuantFormat, N: int, K: int, tensors: dict[str, Any]):
        fmt.verify(K=K, N=N)
        self.fmt = fmt
        self.N = int(N)
        self.K = int(K)
        self.tensors = dict(tensors)
        self.prepared: dict[tuple[str, str], Any] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return (self.N, self.K)

    def with_tensors(self, tensors: dict[str, Any]) -> "QuantizedWeight":
        """The same weight with other arrays (e.g. moved to a device), sharing no cache."""
        return QuantizedWeight(self.fmt, self.N, self.K, tensors)

    def __repr__(self) -> str:
        f = self.fmt
        return (f"QuantizedWeight(N={self.N}, K={self.K}, packing={f.packing.value}, bits={f.bits}, "
                f"group_size={f.group_size}, symmetric={f.symmetric})")

    # -- constructors from checkpoint layouts, dequantize, device moves -------------------------
    # (implemented with the numpy reference packers in ir/packing.py)
    @classmethod
    def from_gguf(cls, data: Any, ggml_type: str, shape: tuple[int, int]) -> "QuantizedWeight":
        """Wrap a GGUF block array (``gguf.quants.quantize`` output) of type "Q4_0" or "Q8_0"."""
        raise NotImplementedError("QuantizedWeight.from_gguf is not implemented yet")

    @classmethod
    def from_awq(cls, qweight: Any, qzeros: Any, scales: Any, *, group_size: int) -> "QuantizedWeight":
        """Wrap AutoAWQ GEMM-layout tensors (see ``Packing.AWQ``)."""
        raise NotImplementedError("QuantizedWeight.from_awq is not implemented yet")

    @classmethod
    def from_gptq(cls, qweight: Any, qzeros: Any, scales: Any, *, group_size: int,
                  g_idx: Any = None) -> "QuantizedWeight":
        """Wrap AutoGPTQ v1 tensors (see ``Packing.GPTQ``)."""
        raise NotImplementedError("QuantizedWeight.from_gptq is not implemented yet")

    def dequantize(self) -> Any:
        """The float32 ``(N, K)`` weight, as the same array type and device as the tensors."""
        raise NotImplementedError("QuantizedWeight.dequantize is not implemented yet")
