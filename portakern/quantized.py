"""``QuantizedWeight``: a quantized ``W (N, K)`` as data (format + packed tensors)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from portakern.ir import packing
from portakern.ir.dtypes import DType
from portakern.ir.quant import GGUF_LAYOUT, Packing, QuantFormat

from .arrays import device_of, kind_of, to_numpy
from .devices import Device
from .errors import InvalidInputError, InvalidTypeError

_GGML_TYPES = {"Q4_0": (Packing.GGUF_Q4_0, 4), "Q8_0": (Packing.GGUF_Q8_0, 8), "Q4_K": (Packing.GGUF_Q4_K, 4),
               "Q5_K": (Packing.GGUF_Q5_K, 5), "Q6_K": (Packing.GGUF_Q6_K, 6)}
_GGML_IDS = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}  # ggml_type enum values


class QuantizedWeight:
    """A weight ``W (N, K)`` stored in a ``QuantFormat``; ``tensors`` holds the packed arrays.

    The tensor names and byte layouts per packing are documented on ``portakern.ir.Packing``.
    Arrays may be numpy, torch or cupy; they all live on one device (checked here, with their
    names, shapes and dtypes). Backends may repack the weight once (``Backend.prepare_weight``);
    the result is cached in ``prepared`` keyed by ``(backend name, device)`` (or the name of the backend whose
    layout it shares, ``Backend.weight_layout``) so repeated calls do no repacking.

    Build one with ``portakern.quantize(w)`` or from a checkpoint with ``from_awq``, ``from_gptq``
    or ``from_gguf``; ``dequantize()`` gives the float32 weight back.
    """

    def __init__(self, fmt: QuantFormat, N: int, K: int, tensors: dict[str, Any]):
        """Wrap packed ``tensors`` holding a ``(N, K)`` weight in format ``fmt``; no data is copied.

        Raises ``InvalidTypeError`` for a ``fmt`` that is not a ``QuantFormat``, an ``N`` or ``K``
        that is not an integer (numpy integers are fine, bools are not), a tensor of the wrong dtype
        or tensors in different libraries/devices; ``InvalidInputError`` for ``N`` or ``K`` < 1, an
        invalid format, tensors whose names or shapes do not match ``fmt``'s layout, or float32
        scales for a bfloat16 ``scale_dtype`` holding a value that is not a bfloat16.
        """
        if not isinstance(fmt, QuantFormat):
            raise InvalidTypeError(f"fmt is a {type(fmt).__name__}: expected a portakern.ir.QuantFormat; "
                                   "build one with QuantFormat(bits, group_size, symmetric, packing)")
        N, K = _dimension(N, "N", "output rows"), _dimension(K, "K", "input columns")
        packing.validate_tensors(fmt, tensors, N, K)
        if fmt.scale_dtype is DType.bfloat16 and str(tensors["scales"].dtype).endswith("float32"):
            packing.check_bf16_carrier(fmt, to_numpy(tensors["scales"]))  # one copy of the scales
        self.fmt = fmt
        self.N = N
        self.K = K
        self.tensors = dict(tensors)
        self.prepared: dict[tuple[str, str], Any] = {}
        self._kind, self._device = _placement(self.tensors)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.N, self.K)

    @property
    def device(self) -> Device:
        """The Device every tensor lives on (``portakern.devices.CPU`` for numpy)."""
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors (payload, scales, zeros, g_idx); 0 once they were released."""
        return sum(_nbytes(t) for t in self.tensors.values())

    @property
    def prepared_nbytes(self) -> int:
        """Bytes held by the prepared copies (``prepared``) whose tensors this weight knows (``tensors()``)."""
        return sum(_nbytes(t) for p in self.prepared.values() if hasattr(p, "tensors") and callable(p.tensors)
                   for t in p.tensors().values())

    @property
    def native_released(self) -> bool:
        """Whether the native tensors were released after preparation (``portakern.prepare(...,
        keep_native=False)``): ``tensors`` is then empty and the prepared copy is the only one."""
        return not self.tensors

    def release_native(self) -> None:
        """Drop the native tensors, keeping the prepared copies (``prepared``) as the only resident one; the weight's
        ``device`` becomes the device of its prepared copy. ``portakern.prepare`` calls it unless asked to keep them.
        ``dequantize()`` then reads the prepared copy; ``to()`` another device raises.

        Raises ``InvalidInputError`` when nothing is prepared (the native tensors are then the only copy)."""
        from .gemv_weight import PreparedGemvWeight

        copies = [(k, p) for k, p in self.prepared.items() if isinstance(p, PreparedGemvWeight)]
        if not copies:
            raise InvalidInputError(f"{self!r} has no prepared GEMV copy, so its native tensors are its only copy "
                                    "and cannot be released; prepare it first with portakern.prepare(w, device=...)")
        t = next(iter(copies[0][1].tensors().values()))
        self.tensors = {}
        self._kind, self._device = "torch", device_of(t, "torch")

    def with_tensors(self, tensors: dict[str, Any]) -> "QuantizedWeight":
        """The same weight with other arrays (e.g. moved to a device), sharing no cache."""
        return QuantizedWeight(self.fmt, self.N, self.K, tensors)

    def __repr__(self) -> str:
        f = self.fmt
        return (f"QuantizedWeight(N={self.N}, K={self.K}, packing={f.packing.value}, bits={f.bits}, "
                f"group_size={f.group_size}, symmetric={f.symmetric}, device={self._device})")

    # -- constructors from checkpoint layouts -------------------------------------------------
    @classmethod
    def from_gguf(cls, data: Any, ggml_type: Any, shape: tuple[int, int]) -> "QuantizedWeight":
        """Wrap a GGUF Q4_0, Q8_0, Q4_K, Q5_K or Q6_K block array (see ``Packing.GGUF_*``).

        ``data``: the uint8 array ``gguf.quants.quantize(w, GGMLQuantizationType.Q4_0)`` returns,
        shape ``(N, K // 32 * 18)`` (Q8_0: ``* 34``), or the same bytes flat. ``ggml_type``: "Q4_0",
        "Q8_0", "Q4_K", "Q5_K", "Q6_K", the ``gguf.GGMLQuantizationType`` member or its integer value (2, 8, 12, 13,
        14; numpy integers too); K-quant rows are super-blocks of 256 weights. ``shape``: ``(N, K)`` in numpy order
        (a GGUF file lists dimensions innermost first, so reverse the file's shape). numpy, torch or
        cupy arrays are kept as they are (no copy).
        """
        name = _ggml_name(ggml_type)
        if name not in _GGML_TYPES:
            raise InvalidInputError(
                f"ggml_type={ggml_type!r} is not supported: from_gguf reads {', '.join(_GGML_TYPES)}; for other "
                "types dequantize with gguf.quants.dequantize and call portakern.quantize(w)")
        pk, bits = _GGML_TYPES[name]
        group, symmetric, per_block = GGUF_LAYOUT[pk]
        try:
            N, K = (operator.index(s) for s in shape)  # numpy integers (GGUFReader shapes) too
        except (TypeError, ValueError):
            N = K = 0
        if N < 1 or K < 1 or any(isinstance(s, bool) for s in shape):
            raise InvalidInputError(f"shape={shape!r} must be two positive ints (N, K): pass (rows, columns) in numpy "
                                    "order, the reverse of the dimensions a GGUF file lists")
        if K % per_block:
            raise InvalidInputError(f"shape={tuple(shape)}: K={K} must be a multiple of {per_block} for {name} "
                                    f"({per_block} weights per block); if you passed the GGUF file's shape, reverse it")
        kind_of(data, "data")
        if str(data.dtype).replace("torch.", "") != "uint8":
            raise InvalidTypeError(f"data has dtype {data.dtype}: GGUF blocks are raw bytes, pass the uint8 "
                                   "array gguf.quants.quantize returns (or reinterpret with .view(uint8))")
        block = packing.GGUF_BLOCK_BYTES[pk]
        row = K // per_block * block
        size = 1
        for s in data.shape:
            size *= int(s)
        if size != N * row:
            raise InvalidInputError(
                f"data has shape {tuple(data.shape)} ({size} bytes) but {name} with shape=(N, K)=({N}, {K}) "
                f"needs N * K // {per_block} * {block} = {N * row} bytes; check shape (numpy order "
                "(N, K), the reverse of the GGUF file's) and ggml_type")
        if tuple(data.shape) != (N, row):
            data = data.reshape(N, row)
        return cls(QuantFormat(bits, group, symmetric, pk), N, K, {"data": data})

    @classmethod
    def from_awq(cls, qweight: Any, qzeros: Any, scales: Any, *, group_size: int) -> "QuantizedWeight":
        """Wrap AutoAWQ GEMM-layout tensors (see ``Packing.AWQ``); no data is copied.

        ``qweight`` int32 ``(K, N // 8)``, ``qzeros`` int32 ``(K // group_size, N // 8)``, ``scales``
        ``(K // group_size, N)``; the scale dtype (float16 in AutoAWQ checkpoints) becomes the
        format's ``scale_dtype``. ``group_size=-1`` means one group per row (K); numpy integers are accepted.
        """
        t = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        K, N8 = _dims2(qweight, "qweight", "(K, N // 8)")
        fmt = QuantFormat(4, _group(group_size, K), False, Packing.AWQ, _scale_dtype(scales))
        return cls._checked(fmt, N8 * 8, K, t)

    @classmethod
    def from_gptq(cls, qweight: Any, qzeros: Any, scales: Any, *, group_size: int,
                  g_idx: Any = None, checkpoint_format: str = "gptq") -> "QuantizedWeight":
        """Wrap GPTQ tensors (see ``Packing.GPTQ``); no data is copied except ``g_idx`` and v2 zeros.

        ``qweight`` int32 ``(K // 8, N)``, ``qzeros`` int32 ``(K // group_size, N // 8)``, ``scales``
        ``(K // group_size, N)``, ``g_idx`` optional ``(K,)`` integers (act-order). A ``g_idx`` equal
        to ``arange(K) // group_size`` carries no information and is dropped (``fmt.has_g_idx``
        False); any other is stored as int32. ``group_size=-1`` means one group per row (K); numpy
        integers are accepted.

        ``checkpoint_format`` (the name GPTQModel's quantize config gives it): ``"gptq"``, AutoGPTQ's
        v1, whose ``qzeros`` hold each zero point minus one; ``"gptq_v2"``, whose ``qzeros`` hold the
        zero points themselves -- copied here into the v1 form the kernels read. Loading a v2
        checkpoint as v1 would put every weight one scale step off, so say which one you have.

        Raises:
          InvalidInputError for a ``checkpoint_format`` other than those two, and for a v2 zero
          point of 0, which the v1 form (zero - 1 in four bits) cannot hold.
        """
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise InvalidInputError(f"checkpoint_format={checkpoint_format!r}: expected 'gptq' (AutoGPTQ v1: qzeros "
                                    "hold zero - 1) or 'gptq_v2' (qzeros hold the zero points); the checkpoint's "
                                    "quantize_config.json names it")
        t = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        K8, N = _dims2(qweight, "qweight", "(K // 8, N)")
        K = K8 * 8
        G = _group(group_size, K)
        has_g_idx = False
        if g_idx is not None:
            import numpy as np

            kind = kind_of(g_idx, "g_idx")
            host = to_numpy(g_idx)
            if not np.issubdtype(host.dtype, np.integer):
                raise InvalidTypeError(f"g_idx has dtype {g_idx.dtype}: it must hold integer group indices; "
                                      "convert exact values with .astype(numpy.int32) / .to(torch.int32)")
            QuantFormat(4, G, False, Packing.GPTQ).verify(K=K, N=N)
            packing.check_g_idx(host, K, G)
            if not np.array_equal(host, np.arange(K) // G):
                has_g_idx = True
                t["g_idx"] = g_idx.to(_torch().int32) if kind == "torch" else g_idx.astype("int32")
        fmt = QuantFormat(4, G, False, Packing.GPTQ, _scale_dtype(scales), has_g_idx=has_g_idx)
        if checkpoint_format == "gptq_v2":  # the same layout as v1: checked first, then the zeros rewritten
            packing.validate_tensors(fmt, t, N, K, argument=None)
            t["qzeros"] = _like(packing.gptq_v2_zeros_to_v1(to_numpy(qzeros)), qzeros)
        return cls._checked(fmt, N, K, t)

    @classmethod
    def _checked(cls, fmt: QuantFormat, N: int, K: int, tensors: dict[str, Any]) -> "QuantizedWeight":
        packing.validate_tensors(fmt, tensors, N, K, argument=None)  # messages name the arguments
        return cls(fmt, N, K, tensors)

    # -- values and devices -------------------------------------------------------------------
    def dequantize(self) -> Any:
        """The float32 ``(N, K)`` weight, as the same array type and device as the tensors.

        Computed by the numpy reference (``portakern.ir.packing.dequantize``, float64, then
        rounded once to float32); GPU tensors are copied to the host and the result copied back.
        After the native tensors were released (``native_released``) it reads the prepared copy
        (``portakern.gemv_weight.dequantize_prepared``; the same values) and returns a torch tensor on its device.
        """
        if self.native_released:
            from .gemv_weight import PreparedGemvWeight, dequantize_prepared

            p = next(p for p in self.prepared.values() if isinstance(p, PreparedGemvWeight))
            out = dequantize_prepared(p).astype("float32")
            return _like(out, p.scales)
        host = {k: to_numpy(v) for k, v in self.tensors.items()}
        out = packing.dequantize(self.fmt, host, self.N, self.K).astype("float32")
        return _like(out, next(iter(self.tensors.values())))

    def to(self, device: Any) -> "QuantizedWeight":
        """This weight with its tensors on ``device`` ("cpu", "cuda", "cuda:1", a ``Device`` or a
        ``torch.device``); ``self`` when they are already there.

        torch tensors move with ``Tensor.to``; numpy arrays become torch tensors when a GPU device
        is asked (copied first when their strides are negative, which torch cannot wrap); cupy
        arrays come back to the host as numpy for "cpu"; "opencl:<n>" gives pyopencl arrays on that
        OpenCL device (pyopencl arrays come back as numpy for "cpu"). The result shares no ``prepared`` cache
        with ``self``.
        """
        target = _parse_target(device)
        here = "cpu" if self._device.type == "cpu" else f"{'opencl' if self._device.type == 'opencl' else 'cuda'}:" \
            f"{self._device.index}"
        if target == here:
            return self
        if self.native_released:
            raise InvalidInputError(f"{self!r}.to({device!r}): the native tensors were released after preparation "
                                    f"(portakern.prepare(..., keep_native=False)), so only the prepared copy on {here} "
                                    "is left; prepare with keep_native=True to move the weight later, or "
                                    "portakern.quantize(w.dequantize().to(...)) again")
        if target.startswith("opencl:"):  # pyopencl arrays on that device's cached queue
            import pyopencl.array as cla

            from .devices import Device
            from .opencl_runtime import queue

            q = queue(Device("opencl", int(target.partition(":")[2])))
            return self.with_tensors({k: cla.to_device(q, np.ascontiguousarray(to_numpy(v)))
                                      for k, v in self.tensors.items()})
        if target == "cpu" and self._kind == "pyopencl":
            return self.with_tensors({k: to_numpy(v) for k, v in self.tensors.items()})
        if target == "cpu":
            moved = {k: (v.cpu() if self._kind == "torch" else to_numpy(v)) for k, v in self.tensors.items()}
        else:
            torch = _torch()
            moved = {k: (torch.from_numpy(np.ascontiguousarray(to_numpy(v))) if self._kind in ("numpy", "pyopencl") else
                         torch.from_dlpack(v) if self._kind == "cupy" else v).to(target)
                     for k, v in self.tensors.items()}
        return self.with_tensors(moved)


# -- helpers -----------------------------------------------------------------------------------

def _like(host: Any, a: Any) -> Any:
    """The numpy array ``host`` as ``a``'s array type on ``a``'s device."""
    kind = kind_of(a)
    if kind == "torch":
        return _torch().from_numpy(host).to(a.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(a.device.id):
            return cupy.asarray(host)
    if kind == "pyopencl":
        import pyopencl.array as cla

        return cla.to_device(a.queue, np.ascontiguousarray(host))
    return host


def _torch():
    import torch

    return torch


def _placement(tensors: dict[str, Any]) -> tuple[str, Device]:
    """(array kind, Device) shared by all tensors; ``InvalidTypeError`` when they differ."""
    first = None
    for name, t in tensors.items():
        kind = kind_of(t, f"tensors[{name!r}]")
        dev = device_of(t, kind)
        if first is None:
            first = (name, kind, dev)
        elif (kind, dev) != first[1:]:
            raise InvalidTypeError(
                f"tensors[{name!r}] is a {kind} array on {dev} but tensors[{first[0]!r}] is a {first[1]} "
                f"array on {first[2]}: a QuantizedWeight keeps every tensor in one library on one device; "
                "convert them together, or build it and call .to(device)")
    return first[1], first[2]


def _nbytes(t: Any) -> int:
    if hasattr(t, "element_size"):  # torch
        return int(t.numel() * t.element_size())
    return int(t.nbytes)


def _parse_target(device: Any) -> str:
    """"cpu", "cuda:<i>" (torch's name for NVIDIA and ROCm GPUs alike) or "opencl:<i>"."""
    text = str(device).strip()
    if text == "cpu":
        return "cpu"
    head, _, idx = text.partition(":")
    if head in ("cuda", "rocm") and (idx == "" or idx.isdigit()):
        return f"cuda:{int(idx or 0)}"
    if head == "opencl" and (idx == "" or idx.isdigit()):
        from .devices import parse_device

        return str(parse_device(f"opencl:{int(idx or 0)}"))  # raises naming the present devices
    raise InvalidInputError(f"device={device!r} is not a device QuantizedWeight.to can move to: use "
                            "'cpu', 'cuda', 'cuda:<index>' (rocm devices are 'cuda' to torch) or 'opencl:<index>'")


def _dims2(a: Any, name: str, formula: str) -> tuple[int, int]:
    kind_of(a, name)
    if len(a.shape) != 2:
        raise InvalidInputError(f"{name} has shape {tuple(a.shape)}: it must be 2-D {formula}; pass the tensor "
                                "as the checkpoint stores it (not flattened or transposed)")
    return int(a.shape[0]), int(a.shape[1])


def _dimension(value: Any, name: str, what: str) -> int:
    """``value`` as a Python int >= 1 (numpy integers too); ``InvalidTypeError`` / ``InvalidInputError``."""
    if not _is_int(value):
        raise InvalidTypeError(f"{name}={value!r} must be an int (the weight's {what}), not a "
                               f"{type(value).__name__}; pass int({name})")
    if value < 1:
        raise InvalidInputError(f"{name}={value} must be >= 1 (the weight's {what}): an empty weight has "
                                "nothing to quantize; skip the layer instead")
    return int(value)


def _group(group_size: Any, K: int) -> int:
    """``group_size`` as a Python int (``K`` for -1); Python and numpy integers are accepted, bools are not."""
    if not _is_int(group_size) or (group_size != -1 and group_size < 2):
        raise InvalidInputError(f"group_size={group_size!r} must be an int >= 2, or -1 for one group per "
                                "row; use the value from the checkpoint's quantization config")
    if group_size == -1 and K < 2:
        raise InvalidInputError(f"group_size=-1 makes one group of K={K} column, but a group needs at least 2 "
                                "columns; check that qweight is the checkpoint's tensor, shape as documented")
    return K if group_size == -1 else int(group_size)


def _ggml_name(ggml_type: Any) -> str | None:
    """The ggml type's name: a ``GGMLQuantizationType`` member's, a name string upper-cased, or the name of a
    ggml_type enum value (Python or numpy integer, as a GGUF file stores it)."""
    if _is_int(ggml_type):
        return getattr(ggml_type, "name", None) or _GGML_IDS.get(int(ggml_type))
    return getattr(ggml_type, "name", None) or str(ggml_type).upper()


def _is_int(x: Any) -> bool:
    """A Python or numpy integer scalar (an IntEnum member too); bools are not integers here."""
    import numpy as np

    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _scale_dtype(scales: Any) -> DType:
    kind_of(scales, "scales")
    try:
        dt = DType.parse(str(scales.dtype), argument="scales.dtype")
    except InvalidInputError:
        dt = None
    if dt not in (DType.float16, DType.bfloat16, DType.float32):
        raise InvalidTypeError(f"scales has dtype {scales.dtype}: scales must be float16, bfloat16 or float32; "
                               "convert them (numpy .astype(numpy.float16) / torch .to(torch.float16))")
    return dt
