"""Building OpenCL programs: kernel sources from package data, one ``cl.Program`` per (context, source),
build failures as ``BackendError`` carrying the build log."""

from __future__ import annotations

import hashlib
import threading
from importlib import resources
from typing import Any

from portakern.errors import BackendError
from portakern.lru import LRU

#: built programs and their kernels, the least recently used dropped past the bound (a per-length compile of a
#: growing paged block table makes a program per width); a plan's kernel keeps its own program alive
_programs: LRU = LRU(256)
_kernels: LRU = LRU(1024)
_lock = threading.Lock()


class Launcher:
    """One ``cl.Kernel``, retrieved once; setting its arguments and enqueueing happen under a lock (a kernel
    object's arguments are shared state)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.lock = threading.Lock()

    def __call__(self, queue, global_size, local_size, *args):
        with self.lock:
            return self.kernel(queue, global_size, local_size, *args)


def kernel_source(name: str) -> str:
    """The text of ``kernels/<name>`` (shipped as package data) after ``kernels/storage.cl``, the half / float
    storage types and load / store macros every kernel shares (``IN_HALF`` / ``OUT_HALF`` defines)."""
    kernels = resources.files("portakern.backends.opencl.kernels")
    return kernels.joinpath("storage.cl").read_text() + kernels.joinpath(name).read_text()


def work_group_cap(device, want: int) -> int:
    """The largest power of two <= ``want`` that ``device`` allows in one work-group (``max_work_group_size``
    from its ``Device.info``; a host device means the OpenCL device host arrays run on; a device description
    without the figure keeps ``want``)."""
    if device.type != "opencl":
        from portakern.opencl_runtime import default_device, devices

        device = default_device() if devices() else device
    cap = int(dict(device.info).get("max_work_group_size", want))
    size = 1
    while size * 2 <= min(want, cap):
        size *= 2
    return size


def defines(values: dict[str, int]) -> str:
    return "".join(f"#define {k} {int(v)}\n" for k, v in values.items())


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def build(context: Any, source: str, op_kind: str, entry: str, source_digest: str | None = None) -> Launcher:
    """The kernel ``entry`` of ``source`` built for ``context`` (cached; pyopencl also caches binaries on disk).
    ``source_digest``: ``digest(source)`` when the caller has it (the per-call path passes it: no rehashing).

    Raises ``BackendError`` naming the backend, the op and the compiler's build log when the build fails.
    """
    digest = source_digest or globals()["digest"](source)
    launcher = _kernels.get((context.int_ptr, digest, entry))
    if launcher is not None:
        return launcher
    key = (context.int_ptr, digest)
    prg = _programs.get(key)
    if prg is None:
        import pyopencl as cl

        with _lock:
            prg = _programs.get(key)
            if prg is None:
                try:
                    prg = cl.Program(context, source).build(options=["-cl-std=CL1.2"])
                except cl.Error as e:  # RuntimeError subclasses: build failures, invalid options
                    devices = ", ".join(d.name.strip() for d in context.devices)
                    raise BackendError(f"backend 'opencl' failed to build the {op_kind} kernel {entry} for "
                                       f"{devices}: {type(e).__name__}; build log:\n{_build_log(e)}") from None
                _programs.put(key, prg)
    import pyopencl as cl

    with _lock:
        launcher = _kernels.get((context.int_ptr, digest, entry))
        if launcher is None:
            launcher = Launcher(cl.Kernel(prg, entry))
            _kernels.put((context.int_ptr, digest, entry), launcher)
    return launcher


def _build_log(e: Exception) -> str:
    """The compiler's messages: pyopencl puts each device's build log into the error's text, after "Build on"."""
    text = str(e)
    at = text.find("Build on")
    return (text[at:] if at >= 0 else text)[:8000]
