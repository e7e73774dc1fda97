"""The backend contract suite's placements and helpers: every registered backend, on every device present that it
declares, with every array library that lives on that device.

A ``Target`` is one (backend, device, array library) placement. Tests are written once against the public API
(``portakern.attention`` / ``quant_gemv`` with ``backend=<name>``); whether a backend runs a given problem is its
own ``supports()`` answer, asked through ``portakern.explain`` (``skip_unless_supported``) -- no test names a
backend. A backend whose devices are all absent here gets one placement that skips saying so, so every backend
shows up in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import portakern

#: the array libraries that hold arrays on each device type
LIBRARIES = {"cpu": ("numpy", "torch"), "cuda": ("torch",), "rocm": ("torch",), "opencl": ("pyopencl",)}
#: the float dtypes each library holds (numpy and pyopencl have no bfloat16)
DTYPES = {"numpy": ("float16", "float32"), "torch": ("float16", "bfloat16", "float32"),
          "pyopencl": ("float16", "float32")}


@dataclass(frozen=True)
class Target:
    """One placement: ``backend`` (a registered name) on ``device`` (None: none of its device types is present)
    with arrays of ``lib``."""

    backend: str
    device: Any
    lib: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}-{self.lib}" if self.device is not None else f"{self.backend}-no-device"

    # -- arrays ---------------------------------------------------------------------------------------

    def array(self, a: np.ndarray, dtype: str | None = None) -> Any:
        """``a`` (numpy; floats are cast to ``dtype``) as an array of this target's library on its device."""
        a = np.ascontiguousarray(a)
        if self.lib == "torch":
            import torch

            t = torch.from_numpy(a.astype(np.float32) if dtype else a)
            if dtype:
                t = t.to(getattr(torch, dtype))
            return t.to(self.torch_device)
        a = a.astype(dtype) if dtype else a
        if self.lib == "pyopencl":
            import pyopencl.array as cla

            from portakern.opencl_runtime import queue

            return cla.to_device(queue(self.device), a)
        return a

    def permute(self, a, axes: tuple[int, ...]):
        """A view of ``a`` (of this target's library) with its axes permuted."""
        if self.lib == "torch":
            return a.permute(*axes)
        return a.transpose(axes)

    @property
    def torch_device(self) -> str:
        return "cpu" if self.device.type == "cpu" else f"cuda:{self.device.index}"

    def weight(self, w):
        """A ``QuantizedWeight`` built on the host, on this target's device (host placements keep it there)."""
        return w if self.device.type == "cpu" else w.to(str(self.device))

    def check_like(self, out, dtype: str, shape: tuple) -> None:
        """``out`` is an array of this target's library, on its device, of ``dtype`` and ``shape``."""
        assert tuple(out.shape) == tuple(shape), (tuple(out.shape), shape)
        if self.lib == "torch":
            import torch

            assert isinstance(out, torch.Tensor), type(out)
            assert out.dtype == getattr(torch, dtype) and str(out.device) == str(torch.device(self.torch_device))
        elif self.lib == "pyopencl":
            assert type(out).__module__.startswith("pyopencl"), type(out)
            assert out.dtype == np.dtype(dtype)
            from portakern.opencl_runtime import queue

            assert out.queue.context == queue(self.device).context
        else:
            assert type(out) is np.ndarray and out.dtype == np.dtype(dtype), (type(out), out.dtype)


def host(a) -> np.ndarray:
    """Any library's array as a float64 (or integer) numpy array."""
    if type(a).__module__.startswith("torch"):
        return a.detach().cpu().double().numpy() if a.is_floating_point() else a.cpu().numpy()
    if type(a).__module__.startswith("pyopencl"):
        a = a.get()
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _backends() -> dict:
    return {be.name: be for be in portakern.list_backends()}


def _placements(every_library: bool) -> list[Target]:
    """Each backend on each present device of a type it declares: with every library living there, or with the
    one its kernels take (its ``array_kind``) where that lives there, else the device's first."""
    present = portakern.devices()
    out = []
    for name, be in sorted(_backends().items()):
        devs = [d for d in present if d.type in be.device_types]
        if not devs:
            out.append(Target(name, None, ""))
        for d in devs:
            libs = LIBRARIES.get(d.type, ())
            if not every_library and libs:
                libs = (be.array_kind,) if be.array_kind in libs else libs[:1]
            out += [Target(name, d, lib) for lib in libs]
    return out


#: one placement per backend and device (numerical tests)
TARGETS = _placements(every_library=False)
#: every array library on each such device too (array-type round trips)
TARGETS_EVERY_LIBRARY = _placements(every_library=True)


def skip_unless_supported(fn, *args, **kwargs) -> None:
    """Skip the test with the backend's own reason when ``fn(*args, **kwargs)`` (``backend=`` given) is not
    supported: dispatch's decision, i.e. the backend's ``supports()`` answer. A ``supports()`` that raised or
    returned something other than a ``Support`` is a failure, not a skip."""
    try:
        portakern.explain(fn, *args, **kwargs)
    except portakern.UnsupportedError as e:
        if any(bug in str(e) for bug in BROKEN_SUPPORTS):
            pytest.fail(f"supports() of {kwargs.get('backend')!r} is broken: {e}")
        pytest.skip(f"unsupported: {e}")


#: what dispatch's rejection says when a backend's ``supports()`` raised or answered with the wrong type
BROKEN_SUPPORTS = ("supports() raised", "plugin bug")


def poisoned():
    """Outputs NaN-filled before every kernel: an element a kernel leaves unwritten shows as NaN."""
    from portakern.dispatch import poison_outputs

    return poison_outputs()


#: max |out - float64 reference| for outputs of magnitude ~1, by output dtype (bfloat16: Triton's interpreter
#: converts float32 -> bfloat16 by truncation)
ATOL = {"float32": 3e-5, "float16": 3e-3, "bfloat16": 2.5e-2}
#: the same, relative to max |reference|, for quant_gemv
RTOL_GEMV = {"float32": 3e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
LSE_ATOL = 3e-4


def backend_device_types(name: str) -> tuple[str, ...]:
    """The device types backend ``name`` declares."""
    return tuple(_backends()[name].device_types)
