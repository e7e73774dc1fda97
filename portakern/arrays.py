"""Array interop: numpy, torch, cupy and pyopencl arrays in, the caller's array type out.

Backends receive arrays of their ``array_kind`` ("numpy", "torch" or "pyopencl"). numpy has no bfloat16, so a
bf16 torch tensor reaches a numpy backend as float32 (exact) and its float32 result is cast back; pyopencl arrays
are numpy-typed on the device, so the same holds for a pyopencl backend. A ``pyopencl.array.Array`` lives on its
queue's OpenCL device (``opencl:<n>``, see ``portakern.opencl_runtime``); host arrays converted for a pyopencl
backend go to that device's cached queue.

Any other array that speaks DLPack (``__dlpack__`` and ``__dlpack_device__``: JAX, MLX, ...) is read through it
(``adopt``): a host array as a numpy array (``numpy.from_dlpack``), a device array as a torch tensor
(``torch.from_dlpack``), without a copy; the result is then that numpy array or torch tensor.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from portakern.ir.dtypes import DType

from .devices import CPU, Device, torch_device
from .errors import InvalidTypeError

_NP_NAMES = {DType.float16: "float16", DType.float32: "float32", DType.float64: "float64",
             DType.int8: "int8", DType.uint8: "uint8", DType.int32: "int32", DType.int64: "int64",
             DType.bfloat16: "float32"}
_NP_DTYPES = {d: np.dtype(n) for d, n in _NP_NAMES.items()}
_KINDS: dict[type, str] = {}  # array type -> kind, filled by kind_of
_TORCH_DEVICES: dict[tuple[str, int], Any] = {}  # (device type, index) -> torch.device
_TORCH_DTYPES: dict[DType, Any] = {}             # DType -> torch.dtype


def kind_of(a: Any, argument: str = "array") -> str:
    """"numpy", "torch", "cupy" or "pyopencl"; raise ``InvalidTypeError`` naming ``argument`` otherwise."""
    kind = _KINDS.get(type(a))  # hot path: one dict lookup per array type seen before
    if kind is not None:
        return kind
    mod = type(a).__module__.split(".")[0]
    if mod == "numpy" and hasattr(a, "__array_interface__"):
        kind = "numpy"
    elif mod == "torch" and "torch" in sys.modules and isinstance(a, sys.modules["torch"].Tensor):
        kind = "torch"
    elif mod == "cupy":
        kind = "cupy"
    elif mod == "pyopencl" and "pyopencl.array" in sys.modules and \
            isinstance(a, sys.modules["pyopencl.array"].Array):
        kind = "pyopencl"
    else:
        raise InvalidTypeError(
            f"{argument} is a {type(a).__module__}.{type(a).__name__}: expected a numpy array, "
            "a torch tensor, a cupy array, a pyopencl.array.Array or an array with __dlpack__ and "
            "__dlpack_device__; convert it with numpy.asarray(...) or torch.as_tensor(...)")
    _KINDS[type(a)] = kind
    return kind


#: DLPack device types (``DLDeviceType``) numpy can read: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged
_DLPACK_HOST = (1, 3, 13)


def adopt(a: Any, argument: str = "array") -> Any:
    """``a`` itself when it is None or an array type portakern knows (or not an array at all: validation names
    it); a DLPack-only array (JAX, MLX, ...) as a numpy array when it lives on the host, else as a torch tensor.

    Raises ``InvalidTypeError`` naming ``argument`` when DLPack cannot hand the array over (a dtype numpy cannot
    hold, such as bfloat16, or a device array without torch installed), with the way out."""
    if a is None or type(a) in _KINDS:
        return a
    try:
        kind_of(a, argument)
        return a
    except InvalidTypeError:
        if not (hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__")):
            return a
    where = a.__dlpack_device__()
    try:
        if int(where[0]) in _DLPACK_HOST:
            return np.from_dlpack(a)
        import torch

        return torch.from_dlpack(a)
    except ImportError:
        raise InvalidTypeError(f"{argument} is a {type(a).__module__}.{type(a).__name__} on DLPack device {tuple(where)}: "
                               "a device array is read as a torch tensor and torch is not installed; pip install "
                               "torch, or pass a host array") from None
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise InvalidTypeError(f"{argument} is a {type(a).__module__}.{type(a).__name__} that DLPack cannot hand "
                               f"over ({type(e).__name__}: {e}); convert it to a numpy array or torch tensor "
                               "first (e.g. numpy.asarray(...), or float32 for a bfloat16 host array)") from None


def device_of(a: Any, kind: str) -> Device:
    """The Device an array lives on."""
    if kind == "numpy":
        return CPU
    if kind == "torch":
        d = a.device
        if d.type == "cpu":
            return CPU
        if d.type == "cuda":
            return torch_device("cuda", d.index if d.index is not None else 0)
        raise InvalidTypeError(f"torch device {d} is not supported: use a cpu or cuda tensor")
    if kind == "pyopencl":
        from .opencl_runtime import device_for

        return device_for(a.queue.device)
    return torch_device("cuda", a.device.id)  # cupy


def dtype_of(a: Any, kind: str) -> DType:
    """The IR dtype of an array (ml_dtypes' numpy bfloat16 included)."""
    return DType.parse(str(a.dtype))


def is_contiguous(a: Any, kind: str) -> bool:
    if kind == "torch":
        return a.is_contiguous()
    if kind == "pyopencl":
        return bool(a.flags.c_contiguous)
    return bool(a.flags["C_CONTIGUOUS"])


def to_numpy(a: Any) -> Any:
    """A numpy view/copy of any supported array (bf16 becomes float32)."""
    kind = kind_of(a)
    if kind == "numpy":
        if a.dtype.isbuiltin != 1 and a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16
            return a.astype(np.float32)
        return a
    if kind == "torch":
        if a.requires_grad:
            a = a.detach()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        return a.numpy() if a.is_cpu else a.cpu().numpy()
    if kind == "pyopencl" and not (a.flags.c_contiguous or a.flags.f_contiguous):
        return _strided_pyopencl_to_numpy(a)
    return a.get()  # cupy and pyopencl: a device -> host copy


def _strided_pyopencl_to_numpy(a: Any) -> np.ndarray:
    """A host copy of a strided pyopencl view (a column of a wider table, a reversed array), which pyopencl's
    ``get`` refuses: the bytes its elements span are read from its buffer, then taken at its strides."""
    import pyopencl as cl

    if a.size == 0:
        return np.empty(a.shape, a.dtype)
    low = sum(st * (n - 1) for st, n in zip(a.strides, a.shape) if st < 0)      # bytes before the first element
    high = sum(st * (n - 1) for st, n in zip(a.strides, a.shape) if st > 0) + a.dtype.itemsize
    host = np.empty(high - low, np.uint8)
    cl.enqueue_copy(a.queue, host, a.base_data, src_offset=a.offset + low).wait()
    return np.ndarray(a.shape, a.dtype, buffer=host, offset=-low, strides=a.strides).copy()


def convert_for_backend(a: Any, backend: Any, device: Device) -> Any:
    """Convert ``a`` to ``backend.array_kind`` on ``device``; None passes through.

    numpy to torch shares memory, except for a view torch cannot hold (a negative stride, ``a[::-1]``, or one
    that is not a multiple of the element size, a structured array's field): that one is copied.
    """
    if a is None:
        return None
    kind = kind_of(a)
    if backend.array_kind == "numpy":
        return to_numpy(a)
    if backend.array_kind == "torch":
        import torch

        if kind == "torch":
            t = a
        elif kind == "numpy":
            if any(st < 0 or st % a.itemsize for st in a.strides):  # torch.from_numpy refuses these: copy
                a = np.ascontiguousarray(a)
            t = torch.from_numpy(a)
        else:
            t = torch.from_dlpack(a)
        if device.type in ("cuda", "rocm") and not t.is_cuda:  # is_cuda: no torch.device object built
            t = t.to(f"cuda:{device.index}")
        return t
    if backend.array_kind == "pyopencl":
        if kind == "pyopencl":
            return a
        import pyopencl.array as cla

        from .opencl_runtime import queue

        return cla.to_device(queue(device), np.ascontiguousarray(to_numpy(a)))
    raise InvalidTypeError(f"backend {backend.name!r} declares unknown array_kind {backend.array_kind!r}")


def empty(kind: str, shape: tuple[int, ...], dtype: DType, device: Device, poison: bool = False,
          like: Any = None) -> Any:
    """Allocate an uninitialised (or NaN-filled when ``poison``) array for a backend.

    ``like``: an array of kind ``kind`` already on ``device`` (e.g. a converted input); a torch
    output is then allocated with ``like.new_empty``, which skips parsing the device.
    """
    if kind == "numpy":
        out = np.empty(shape, dtype=_NP_DTYPES[dtype])
        if poison:
            out.fill(np.nan)
        return out
    if kind == "pyopencl":  # on ``like``'s queue (a converted input), else the device's cached one
        import pyopencl.array as cla

        from .opencl_runtime import queue

        out = cla.empty(like.queue if like is not None else queue(device), shape, _NP_DTYPES[dtype])
        if poison:  # pyopencl cannot fill a half array without cl_khr_fp16: write NaN's bits
            if out.dtype == np.float16:
                out.view(np.uint16).fill(np.uint16(0x7E00))
            else:
                out.fill(out.dtype.type(np.nan) if out.dtype.kind == "f" else 0)
        return out
    import torch

    tdt = _TORCH_DTYPES.get(dtype)
    if tdt is None:
        tdt = _TORCH_DTYPES[dtype] = getattr(torch, dtype.value)
    if like is not None:
        out = like.new_empty(shape, dtype=tdt)
    else:
        tdev = _TORCH_DEVICES.get((device.type, device.index))
        if tdev is None:
            tdev = _TORCH_DEVICES[(device.type, device.index)] = torch.device(
                "cpu" if device.type == "cpu" else f"cuda:{device.index}")
        out = torch.empty(shape, dtype=tdt, device=tdev)
    if poison:
        out.fill_(float("nan"))
    return out


def to_caller(out: Any, caller_kind: str, like: Any, dtype: DType) -> Any:
    """Return a backend result as the caller's array type on the caller's device, in ``dtype``."""
    if caller_kind == "pyopencl":
        target = _NP_DTYPES[dtype]
        return out if out.dtype == target else out.astype(target)
    if type(out).__module__.startswith("pyopencl"):  # a pyopencl backend's result for a host caller
        out = out.get()
    if caller_kind == "numpy":
        if not isinstance(out, np.ndarray):
            out = to_numpy(out)
        target = _NP_DTYPES[dtype]
        if dtype is DType.bfloat16 and like.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 in, out
            target = like.dtype
        return out if out.dtype == target else out.astype(target)
    if caller_kind == "torch":
        import torch

        if not isinstance(out, torch.Tensor):
            out = torch.from_numpy(out)
        tdt = _TORCH_DTYPES.get(dtype)
        if tdt is None:
            tdt = _TORCH_DTYPES[dtype] = getattr(torch, dtype.value)
        if out.is_cuda != like.is_cuda:  # outputs are allocated on the inputs' device, so only
            out = out.to(like.device)    # a host result for device inputs (numpy backend) moves
        return out if out.dtype == tdt else out.to(tdt)
    import cupy

    return cupy.from_dlpack(out) if not isinstance(out, cupy.ndarray) else out
