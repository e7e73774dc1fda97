"""Shared by the CUDA C experiments (``gemv_cluster.py``, ``gemv_wide.py``): compile a ``.cu`` file to a cubin with
NVRTC through ``cuda.bindings`` (``nvcc`` where NVRTC cannot be loaded), read ptxas' report, and launch a kernel on
the current torch stream through the driver API (optionally as a programmatic dependent)."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import tempfile


def compile_cubin(source: str, defs: dict[str, int], arch: str = "sm_90a") -> tuple[bytes, str]:
    """The cubin of ``source`` with ``-D`` ``defs`` for ``arch`` and the compiler's log (ptxas' register and spill
    report): NVRTC through ``cuda.bindings``, else ``nvcc`` where NVRTC cannot be loaded."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except (ImportError, OSError, RuntimeError) as e:
        return _compile_nvcc(source, defs, arch, why=f"{type(e).__name__}: {e}")
    return _compile_nvrtc(source, defs, arch)


def _compile_nvcc(source: str, defs: dict[str, int], arch: str, why: str) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        cmd = ["nvcc", "--cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-o", cubin, source]
        cmd += [f"-D{k}={v}" for k, v in defs.items()]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"nvcc failed for {defs} (NVRTC unavailable: {why}):\n{p.stderr}")
        return open(cubin, "rb").read(), p.stderr


def _compile_nvrtc(source: str, defs: dict[str, int], arch: str) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    src = open(source, "rb").read()
    err, prog = nvrtc.nvrtcCreateProgram(src, os.path.basename(source).encode(), 0, [], [])
    _nvrtc_ok(err, "create")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
    opts += [f"-D{k}={v}".encode() for k, v in defs.items()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace").rstrip("\x00 \n")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC failed for {defs}:\n{log}")
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    _nvrtc_ok(err, "cubin size")
    cubin = b" " * size
    (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
    _nvrtc_ok(err, "cubin")
    return cubin, log


def _nvrtc_ok(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC {what}: {err}")


def cu_ok(res, what: str):
    """``cuda.bindings.driver`` calls return (error, *values): the values, or an error naming the call."""
    from cuda.bindings import driver as cu

    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver {what}: {err}")
    return vals[0] if len(vals) == 1 else vals


def registers(log: str) -> dict:
    """ptxas' report in a compiler log: registers, spill stores / loads, static shared memory."""
    find = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None   # noqa: E731
    return {"registers": find(r"Used (\d+) registers"), "spill_stores": find(r"(\d+) bytes spill stores"),
            "spill_loads": find(r"(\d+) bytes spill loads"), "smem": find(r"(\d+) bytes smem")}


class Kernel:
    """A loaded kernel: ``Kernel(cubin, name, grid, threads, smem, pdl)(*pointers)`` launches it on the current
    torch stream (``smem`` bytes of dynamic shared memory, opted in above 48 KiB; ``pdl``: as a programmatic
    dependent of the kernel before it)."""

    def __init__(self, cubin: bytes, name: str, grid: int, threads: int, smem: int = 0, pdl: bool = False):
        from cuda.bindings import driver as cu

        self.module = cu_ok(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.fn = cu_ok(cu.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
        if smem > 48 * 1024:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            cu_ok(cu.cuFuncSetAttribute(self.fn, attr, smem), "cuFuncSetAttribute")
        self.grid, self.threads, self.smem, self.pdl = grid, threads, smem, pdl

    def __call__(self, *ptrs: int) -> None:
        import torch
        from cuda.bindings import driver as cu

        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.threads, 1, 1
        cfg.sharedMemBytes = self.smem
        cfg.hStream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        attrs = []
        if self.pdl:
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs, cfg.numAttrs = attrs, len(attrs)
        cu_ok(cu.cuLaunchKernelEx(cfg, self.fn, (ptrs, (ctypes.c_void_p,) * len(ptrs)), 0), "cuLaunchKernelEx")
