"""Shared pieces of the triton backend's tests: ops and inputs, a launch on NaN-poisoned outputs, the cpu backend's
float64 kernel as reference, tolerances, and the mark of the tests that need Triton's compiler.

Triton chooses when it decorates a kernel whether ``@triton.jit`` interprets (``TRITON_INTERPRET``), so one
process runs kernels either under the CPU interpreter or compiled. Tests that launch kernels on the CPU are marked
``pytest.mark.interpreter`` (scripts/test.sh runs them in their own step with TRITON_INTERPRET=1; elsewhere they
are skipped, saying so: tests/conftest.py); tests that lower with Triton's compiler are ``needs_compiler`` (skipped
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from portakern.backends.cpu.attention import attention_kernel  # noqa: E402
from portakern.devices import CPU  # noqa: E402
from portakern.ir import Attention, DType  # noqa: E402


needs_compiler = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="lowers kernels with Triton's compiler, which TRITON_INTERPRET=1 replaces "
                                           "by the interpreter in this process")

TORCH_DTYPE = {DType.float16: torch.float16, DType.bfloat16: torch.bfloat16, DType.float32: torch.float32}
#: max |triton - float64 reference| on outputs of O(1); LSE gets the fp32 figure
ATOL = {DType.float32: 2e-5, DType.float16: 3e-3, DType.bfloat16: 2.5e-2}
LSE_ATOL = 2e-4


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    """Generated expression modules go to a temporary cache for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORTAKERN_CACHE_DIR", str(tmp_path_factory.mktemp("portakern-cache")))
        yield



def make_op(B=1, Sq=8, Sk=8, Hq=2, Hkv=2, D=32, Dv=None, dtype=DType.float16, **kw) -> Attention:
    kw.setdefault("scale", 1.0 / math.sqrt(D))
    return Attention(batch=B, seqlen_q=Sq, seqlen_k=Sk, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                     head_dim_v=Dv or D, dtype=dtype, return_lse=kw.pop("return_lse", True), **kw).verify()



def tensors(op: Attention, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, dt = op.shapes(), TORCH_DTYPE[op.dtype]
    return tuple(torch.randn(s[n], generator=g).to(dt) for n in ("q", "k", "v"))



def run_triton(op: Attention, q, k, v, aux=None):
    """Compile for the CPU (interpreter) and launch on NaN-poisoned outputs."""
    from portakern.backends.triton.backend import TritonBackend

    be = TritonBackend()
    assert be.supports(op, CPU), be.supports(op, CPU).reason
    kern = be.compile(op, CPU)
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=TORCH_DTYPE[op.dtype])
    lse = torch.full(s["lse"], float("nan"), dtype=torch.float32) if op.return_lse else None
    kern(q, k, v, out, lse, dict(aux or {}))
    assert not torch.isnan(out).any(), "out has NaN: an element was left unwritten or the math broke"
    if lse is not None:
        assert not torch.isnan(lse).any(), "lse has NaN: an element was left unwritten"
    return out, lse, kern



def sm90_device(what: str):
    """The first CUDA device, for tests of ``what`` (a Gluon kernel for sm_90): skipped without one, or when
    it is not sm_90 (the lowering tests cover the kernel off the GPU)."""
    from portakern.devices import detect_devices

    devs = [d for d in detect_devices() if d.type == "cuda"]
    if not devs:
        pytest.skip(f"no CUDA device on this machine: the lowering tests cover {what} off the GPU")
    if tuple(devs[0].capability) != (9, 0):
        pytest.skip(f"{what} runs on sm_90, this device is {devs[0].arch}")
    return devs[0]



def run_reference(op: Attention, q, k, v, aux=None):
    """The cpu backend's float64 kernel on the same values."""
    s = op.shapes()
    out = np.zeros(s["out"], dtype=np.float64)
    lse = np.zeros(s["lse"], dtype=np.float64) if op.return_lse else None
    np_aux = {n: (None if a is None else a.numpy()) for n, a in (aux or {}).items()}
    attention_kernel(op)(*(t.double().numpy() for t in (q, k, v)), out, lse, np_aux)
    return out, lse



def check(op: Attention, q, k, v, aux=None):
    out, lse, kern = run_triton(op, q, k, v, aux)
    ref_out, ref_lse = run_reference(op, q, k, v, aux)
    err = np.abs(out.double().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g} > {ATOL[op.dtype]}"
    if lse is not None:
        got = lse.double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse)), "lse is -inf on different rows"
        fin = np.isfinite(ref_lse)
        if fin.any():
            lerr = np.abs(got[fin] - ref_lse[fin]).max()
            assert lerr <= LSE_ATOL, f"max |lse - ref| = {lerr:.3g}"
    return out, lse, kern

