"""Building OpenCL programs: kernel sources from package data, one ``cl.Program`` per (context, source),
build failures as ``BackendError`` carrying the build log."""

from __future__ import annotations

import hashlib
import threading
from importlib import resources
from typing import Any

from portakern.errors import BackendError

_programs: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()


def kernel_source(name: str) -> str:
    """The text of ``kernels/<name>`` (shipped as package data)."""
    return resources.files("portakern.backends.opencl.kernels").joinpath(name).read_text()


def defines(values: dict[str, int]) -> str:
    return "".join(f"#define {k} {int(v)}\n" for k, v in values.items())


def build(context: Any, source: str, op_kind: str, entry: str) -> Any:
    """The kernel ``entry`` of ``source`` built for ``context`` (cached; pyopencl also caches binaries on disk).

    Raises ``BackendError`` naming the backend, the op and the compiler's build log when the build fails.
    """
    key = (context.int_ptr, hashlib.sha256(source.encode()).hexdigest())
    prg = _programs.get(key)
    if prg is None:
        import pyopencl as cl

        with _lock:
            prg = _programs.get(key)
            if prg is None:
                try:
                    prg = cl.Program(context, source).build(options=["-cl-std=CL1.2"])
                except cl.Error as e:  # RuntimeError subclasses: build failures, invalid options
                    log = _build_log(e)
                    raise BackendError(f"backend 'opencl' failed to build the {op_kind} kernel {entry}: "
                                       f"{type(e).__name__}: {str(e)[:4000]}" + (f"\nbuild log:\n{log}" if log else "")) \
                        from None
                _programs[key] = prg
    return getattr(prg, entry)


def _build_log(e: Exception) -> str:
    """The build log pyopencl attached to a build error (its message carries it too)."""
    logs = []
    for arg in getattr(e, "args", ()):
        for item in getattr(arg, "build_logs", ()) or ():
            logs.append(str(item[1]) if isinstance(item, tuple) else str(item))
    return "\n".join(logs)[:8000]
