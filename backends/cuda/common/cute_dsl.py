"""The cuda backend's CuTe DSL machinery: whether the DSL imports, and lowering a kernel for a target without a GPU.

CuTe DSL (``nvidia-cutlass-dsl``, the ``[cuda]`` extra) traces a ``@cute.jit`` function into MLIR and compiles it to
PTX and a cubin with its own bundled compiler; neither step touches the CUDA driver when the target architecture is
given (``--gpu-arch``) and the arguments are fake tensors (``cutlass.cute.runtime.make_fake_compact_tensor``). So a
CPU-only machine lowers for sm_90a and sm_100a, and the PTX / cubin come back through ``--keep-ptx --keep-cubin``
(written to a private temporary directory, never the working directory).

    lower(fn, args, "sm_90a")    # -> Lowered(target, ptx, cubin, registers, frame_bytes, seconds), compiled
"""

from __future__ import annotations

import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cubin_info import cubin_resources

#: how to get the DSL
INSTALL = "pip install 'portakern[cuda]' (it brings nvidia-cutlass-dsl)"
#: the DSL's tracer and compiler keep global state: one lowering at a time
_LOCK = threading.Lock()


def unavailable() -> str | None:
    """None when CuTe DSL imports, else why not (with the install line)."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # an ImportError, or a broken wheel failing inside its own import
        return f"CuTe DSL (nvidia-cutlass-dsl) does not import ({type(e).__name__}: {e}); {INSTALL}"
    return None


def version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None."""
    from importlib import metadata

    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Lowered:
    """What one CuTe DSL lowering produced for ``target``: the PTX text, the cubin, the registers a thread and the
    stack frame a thread (bytes; where spilled registers go) read from the cubin, and the seconds it took."""

    target: str
    ptx: str
    cubin: bytes
    registers: int | None
    frame_bytes: int | None
    seconds: float

    def count(self, pattern: str) -> int:
        """How many PTX instructions match the regular expression ``pattern`` (e.g. ``r"wgmma\\.mma_async"``)."""
        return len(re.findall(pattern, self.ptx))


def _artifact(value, binary: bool):
    """An artifact the DSL hands back: the content itself, or the path of the file it dumped."""
    if value is None:
        return None
    if isinstance(value, (str, Path)) and len(str(value)) < 4096 and Path(value).is_file():
        return Path(value).read_bytes() if binary else Path(value).read_text()
    return value


def lower(fn, args: tuple, target: str):
    """Compile the ``@cute.jit`` callable ``fn`` for ``target`` (e.g. "sm_90a") on fake ``args``; no GPU needed.

    Returns ``(Lowered, compiled)``: the artifacts and the DSL's compiled function (launchable with real arguments
    on a device of that architecture). Raises RuntimeError when the DSL produced no PTX or cubin.
    """
    import cutlass.cute as cute

    with _LOCK, tempfile.TemporaryDirectory(prefix="portakern-cute-") as dump:
        t0 = time.perf_counter()
        compiled = cute.compile(fn, *args, options=f"--keep-ptx --keep-cubin --gpu-arch {target} --dump-dir {dump}")
        seconds = time.perf_counter() - t0
        ptx = _artifact(compiled.artifacts.PTX, binary=False)
        cubin = _artifact(compiled.artifacts.CUBIN, binary=True)
    if not ptx or not cubin:
        raise RuntimeError(f"CuTe DSL compiled for {target} but returned no {'PTX' if not ptx else 'cubin'}")
    res = cubin_resources(cubin) or {}
    return Lowered(target, ptx, cubin, res.get("registers"), res.get("frame_bytes"), seconds), compiled


__all__ = ["INSTALL", "Lowered", "lower", "unavailable", "version"]
