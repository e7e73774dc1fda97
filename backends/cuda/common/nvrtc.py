"""NVRTC and driver-API plumbing of the cuda backend: a kernel's CUDA C source (package data) compiled to a cubin
for one target with its ``-D`` constants (cached per process), loaded into a device's primary context, and launched
on the current torch stream, optionally as a programmatic dependent of the kernel before it (sm_90+).

Needs ``cuda-bindings`` and an NVRTC library (``pip install 'portakern[cuda]'``: both from the package index, so
CI lowers the kernels with no GPU and no CUDA toolkit); launching needs the NVIDIA driver as well.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from dataclasses import dataclass
from importlib import resources

from portakern.errors import BackendError

from .cubin_info import cubin_resources

_lock = threading.Lock()
_REGISTERS = re.compile(r"Used (\d+) registers")      # ptxas' report line (absent on a compute-cache hit)


def unavailable() -> str | None:
    """Why this machine cannot compile the backend's kernels (None when it can)."""
    try:
        from cuda.bindings import nvrtc
    except Exception as e:
        return f"{type(e).__name__}: {e} (pip install 'portakern[cuda]': cuda-bindings and nvidia-cuda-nvrtc)"
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception as e:
        return (f"the NVRTC library cannot be loaded: {type(e).__name__}: {e} (pip install nvidia-cuda-nvrtc, or "
                "install the CUDA toolkit)")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"nvrtcVersion failed: {err}"
    return None


def source(name: str) -> str:
    """The text of ``kernels/<name>`` (shipped as package data)."""
    return resources.files("portakern.backends.cuda.kernels").joinpath(name).read_text()


@dataclass(frozen=True)
class Compiled:
    """A cubin and ptxas' report on it. On a machine with a CUDA driver NVRTC may answer from the driver's compute
    cache, whose hits come with no ptxas report in the log (``cubin_info``): ``registers`` then reads the cubin,
    ``spill_bytes`` is None, and ``frame_bytes`` (read from the cubin either way) says whether anything spilled."""

    cubin: bytes
    log: str
    target: str

    @property
    def ptxas_ran(self) -> bool:
        """Whether the log holds ptxas' report (False on a compute-cache hit)."""
        return _REGISTERS.search(self.log) is not None

    @property
    def registers(self) -> int | None:
        """Registers a thread of the kernel uses (ptxas' report, else the cubin's record)."""
        m = _REGISTERS.search(self.log)
        if m:
            return int(m.group(1))
        res = cubin_resources(self.cubin)
        return res["registers"] if res else None

    @property
    def spill_bytes(self) -> int | None:
        """Bytes of spill stores plus loads in ptxas' report; None when ptxas did not run (a compute-cache hit)."""
        if not self.ptxas_ran:
            return None
        return sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", self.log))

    @property
    def frame_bytes(self) -> int:
        """Bytes of stack frame a thread (the cubin's record): where spilled registers are kept, 0 when none are."""
        res = cubin_resources(self.cubin)
        return res["frame_bytes"] if res else 0


@functools.lru_cache(maxsize=256)
def compile_source(name: str, defines: tuple[tuple[str, int], ...], target: str) -> Compiled:
    """``kernels/<name>`` compiled by NVRTC for ``target`` (e.g. "sm_90a") with ``-D`` ``defines`` (cached)."""
    return compile_text(source(name), name, defines, target)


def compile_text(text: str, name: str, defines: tuple[tuple[str, int], ...], target: str) -> Compiled:
    """CUDA C ``text`` (called ``name`` in messages) compiled by NVRTC for ``target`` with ``-D`` ``defines``.

    Raises:
      BackendError with the compiler's log when NVRTC rejects the source.
    """
    from cuda.bindings import nvrtc

    def ok(err, what):
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BackendError(f"NVRTC {what} failed for {name} ({target}): {err}")

    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    ok(err, "create")
    try:
        opts = [f"--gpu-architecture={target}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
        opts += [f"-D{k}={v}".encode() for k, v in defines]
        (err_compile,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if err_compile != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BackendError(f"NVRTC could not compile {name} for {target} with {dict(defines)}:\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        ok(err, "cubin size")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        ok(err, "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return Compiled(bytes(cubin), log, target)


def _driver_ok(res, what: str):
    """``cuda.bindings.driver`` calls return (error, *values): the values, or a BackendError naming the call."""
    from cuda.bindings import driver as cu

    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise BackendError(f"CUDA driver {what} failed: {err}")
    return vals[0] if len(vals) == 1 else vals


class Function:
    """A compiled kernel loaded on CUDA device ``index`` (into the primary context torch uses), launched with
    ``fn(grid, threads, smem, *pointers)`` on the current torch stream of that device; ``pdl``: as a programmatic
    dependent of the kernel before it in the stream."""

    def __init__(self, compiled: Compiled, entry: str, index: int, smem: int, pdl: bool):
        import torch
        from cuda.bindings import driver as cu

        with _lock:
            _driver_ok(cu.cuInit(0), "cuInit")
            dev = _driver_ok(cu.cuDeviceGet(index), "cuDeviceGet")
            ctx = _driver_ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _driver_ok(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
            try:
                self.module = _driver_ok(cu.cuModuleLoadData(compiled.cubin), "cuModuleLoadData")
                self.fn = _driver_ok(cu.cuModuleGetFunction(self.module, entry.encode()), "cuModuleGetFunction")
                if smem > 46 * 1024:       # with the kernel's static shared memory, over 48 KiB needs the opt-in
                    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    _driver_ok(cu.cuFuncSetAttribute(self.fn, attr, smem), "cuFuncSetAttribute")
            finally:
                _driver_ok(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
        self.index, self.smem = index, smem
        self._stream = functools.partial(torch._C._cuda_getCurrentRawStream, index)
        self._attrs = []
        if pdl:
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            self._attrs.append(a)

    def __call__(self, grid: int, threads: int, *ptrs: int) -> None:
        from cuda.bindings import driver as cu

        cfg = cu.CUlaunchConfig()      # one per launch: launches from several threads must not share it
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = self.smem
        cfg.hStream = cu.CUstream(self._stream())
        cfg.attrs, cfg.numAttrs = self._attrs, len(self._attrs)
        err, = cu.cuLaunchKernelEx(cfg, self.fn, (ptrs, (ctypes.c_void_p,) * len(ptrs)), 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise BackendError(f"cuLaunchKernelEx failed: {err} (grid {grid}, {threads} threads, {self.smem} bytes "
                               f"of shared memory)")
