"""The cuda backend's kernels run on the CPU: their CUDA C compiled as C++20 by the host compiler (``g++`` or
``$CXX``) against ``kernels/host_shim.h`` -- a block's threads as std::threads at one barrier, blocks one after
another -- and called through ctypes. It checks what the NVRTC lowering cannot: the kernel's loops, index maps,
split-K merge and conversions produce the right numbers, on a machine with no GPU (CI). It says nothing about speed
or about the GPU's memory model; the GPU tests and conformance on a GPU do that.

    out = quant_gemv_on_host(op, prepared_weight, x)            # numpy float32 (M, N): the word kernel
    out = frag_gemv_on_host(op, prepared_weight, x)             # the kernel that reads the fragment layout
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import numpy as np

from portakern.errors import BackendError

_KERNELS = resources.files("portakern.backends.cuda.kernels")


def compiler() -> str | None:
    """The host C++ compiler (``$CXX``, else ``g++``, else ``clang++``) or None."""
    for c in (os.environ.get("CXX"), "g++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


@functools.lru_cache(maxsize=64)
def build(source: str, entry: str, defines: tuple[tuple[str, int], ...]) -> ctypes.CDLL:
    """``kernels/<source>``'s ``entry`` as a shared library with ``pk_run(grid, threads, smem_bytes, args)``.

    Raises:
      BackendError when no host compiler is found or it rejects the source (with its output).
    """
    cxx = compiler()
    if cxx is None:
        raise BackendError("no host C++ compiler (g++ / clang++ / $CXX) to run the cuda kernels on the CPU")
    kdir = str(_KERNELS)
    key = hashlib.sha256(repr((source, entry, defines, (_KERNELS / source).read_text(),
                               (_KERNELS / "host_shim.h").read_text(),
                               (_KERNELS / "host_launch.cpp").read_text())).encode()).hexdigest()[:20]
    out = os.path.join(tempfile.gettempdir(), f"portakern-cuda-host-{key}.so")
    if not os.path.exists(out):
        cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-x", "c++", "-DPK_HOST",
               f'-DPK_SOURCE="{source}"', f"-DPK_ENTRY={entry}", "-I", kdir, *[f"-D{k}={v}" for k, v in defines],
               "-o", out + ".tmp", os.path.join(kdir, "host_launch.cpp")]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise BackendError(f"{cxx} could not build kernels/{source} for the CPU with {dict(defines)}:\n"
                               f"{p.stderr[-4000:]}")
        os.replace(out + ".tmp", out)
    lib = ctypes.CDLL(out)
    lib.pk_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_void_p)]
    lib.pk_run.restype = ctypes.c_int
    return lib


def run(lib: ctypes.CDLL, grid: int, threads: int, smem: int, *arrays: np.ndarray) -> None:
    """``pk_run`` over ``arrays`` (contiguous numpy arrays, passed by pointer in order)."""
    for a in arrays:
        if not a.flags.c_contiguous:
            raise BackendError("host_run.run: every array must be C-contiguous")
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    lib.pk_run(grid, threads, smem, ptrs)


def _raw16(t) -> np.ndarray:
    """A 16-bit float torch tensor's bits as uint16 numpy (bfloat16 has no numpy dtype)."""
    import torch

    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def quant_gemv_on_host(op, w, x, config=None, num_sms: int = 132) -> np.ndarray:
    """``kernels/gemv_small_m.cu`` for ``op`` run on the CPU: ``w`` the GEMV layout on the CPU
    (``portakern.gemv_weight.prepare_gemv_weight``), ``x`` an (M, K) float16 / bfloat16 torch tensor; float32
    ``(M, N)``."""
    from .. import quant_gemv as C

    cfg = config or C.choose(op, num_sms)
    consts = C.defines(op, cfg, False, C._zero_point(op))
    tiles = -(-op.N // cfg.columns)
    return _run_gemv(op, w, x, C.SOURCE, C.ENTRY, consts, tiles, cfg.splits, cfg.threads, C.smem_bytes(op, cfg),
                     consts["NP"], w.qweight)


def frag_gemv_on_host(op, w, x, config=None, num_sms: int = 132) -> np.ndarray:
    """``kernels/gemv_frag.cu`` (the kernel that reads the fragment layout) for ``op`` run on the CPU: ``w`` the GEMV
    layout on the CPU with its fragments (``prepare_gemv_weight(..., fragments=True)``; its words are not read),
    ``x`` an (M, K) float16 / bfloat16 torch tensor, ``config`` a ``FragConfig`` (default ``choose_frag``); float32
    ``(M, N)``."""
    from .. import quant_gemv as C

    if w.frag is None:
        raise BackendError("frag_gemv_on_host: the prepared weight has no fragments (frag); prepare it with "
                           "fragments=True")
    cfg = config or C.choose_frag(op, num_sms)
    C._check_frag_config(op, cfg)
    consts = C.frag_defines(op, cfg, False, C._zero_point(op))
    tiles = -(-op.N // cfg.rows)
    return _run_gemv(op, w, x, C.FRAG_SOURCE, C.FRAG_ENTRY, consts, tiles, cfg.splits, cfg.threads,
                     C.frag_smem_bytes(op, cfg), tiles * cfg.rows, w.frag)


def _run_gemv(op, w, x, source, entry, consts, tiles, splits, threads, smem, ws_row, codes) -> np.ndarray:
    """One GEMV kernel of the backend on the CPU over NaN-poisoned output and workspace; checks that its arrival
    counters were reset."""
    from portakern.ir.dtypes import DType

    lib = build(source, entry, tuple(consts.items()))
    shape = (op.M, op.N)
    out = np.full(shape, np.nan, np.float32) if op.result_dtype is DType.float32 else np.full(shape, 0x7FFF, np.uint16)
    ws = np.full(splits * op.M * ws_row, np.nan, np.float32)
    counters = np.zeros(tiles, np.uint32)
    s = _raw16(w.scales)
    z = _raw16(w.zeros) if w.zeros is not None else s
    run(lib, tiles * splits, threads, smem, codes.cpu().contiguous().numpy(), s, z, _raw16(x), out, ws, counters)
    if counters.any():
        raise BackendError(f"{entry} left its arrival counters at {counters.tolist()} (each must reset to 0)")
    if op.result_dtype is DType.float32:
        return out
    if op.result_dtype is DType.float16:
        return out.view(np.float16).astype(np.float32)
    return (out.astype(np.uint32) << 16).view(np.float32)
