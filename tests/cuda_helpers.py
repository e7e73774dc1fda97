"""What the cuda backend's CPU-side tests need, and how they react when it is missing: a skip on a developer's
machine, a failure where ``CI`` is set (CI installs all of it, so a missing piece there is a broken setup, not a
reason to check less)."""

from __future__ import annotations

import os

import pytest

from portakern.devices import Device
from portakern.ir import DType, QuantFormat
from portakern.ir.ops import QuantGemv


def _require(why: str | None, what: str) -> None:
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{what} must be checked here (CI is set) but {why}")
        pytest.skip(why)


def require_nvrtc() -> None:
    """NVRTC and cuda-bindings, which lower the cuda backend's CUDA C."""
    from portakern.backends.cuda.common.nvrtc import unavailable

    _require(unavailable(), "the cuda backend's lowering")


def require_cxx() -> None:
    """A host C++ compiler, which runs the cuda kernels' CUDA C on the CPU (``host_run``)."""
    from portakern.backends.cuda.common.host_run import compiler

    _require(None if compiler() is not None else "no host C++ compiler (g++ / clang++)",
             "the cuda kernels on the host")


def require_cute_dsl() -> None:
    """CuTe DSL (nvidia-cutlass-dsl), in which the cuda backend's attention is written."""
    from portakern.backends.cuda.common.cute_dsl import unavailable

    _require(unavailable(), "the cuda backend's CuTe DSL attention")


@pytest.fixture(scope="module", autouse=True)
def cute_dsl_required():
    """Module-wide ``require_cute_dsl`` for a test module that imports it (the CuTe attention tests)."""
    require_cute_dsl()


@pytest.fixture(scope="module")
def backend():
    """The cuda backend, as the registry builds it."""
    from portakern.backends.cuda.backend import CudaBackend

    return CudaBackend()


#: an sm_90 card as the compile-only targets describe it (no GPU)
H200 = Device("cuda", 0, arch="sm_90a", name="H200 (test)", capability=(9, 0), warp_size=32)


def gemv(M=1, N=4096, K=4096, bits=4, gs=128, sym=False, dtype=DType.bfloat16, **kw):
    """A ``QuantGemv`` op; ``packing``, ``scale_dtype``, ``has_g_idx`` go to its format, the rest to the op."""
    fmt_kw = {k: kw.pop(k) for k in ("packing", "scale_dtype", "has_g_idx") if k in kw}
    return QuantGemv(M=M, N=N, K=K, dtype=dtype, fmt=QuantFormat(bits=bits, group_size=gs, symmetric=sym, **fmt_kw),
                     **kw)


@pytest.fixture
def C():
    """The cuda backend's GEMV module (``backends/cuda/quant_gemv.py``), NVRTC required."""
    require_nvrtc()
    from portakern.backends.cuda import quant_gemv

    return quant_gemv
