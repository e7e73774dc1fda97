"""The opencl backend's attention internals on the OpenCL device (PoCL in CI): its kernel, called below the API, writes
varlen padding rows; its priority hook's choices. Values, layouts, masks, head dims, LSE, empty rows, poisoned
outputs and array kinds are the contract suite's (tests/contract), run on this backend too."""

from __future__ import annotations

import numpy as np
import pytest

import portakern

from opencl_helpers import require_opencl, to_cl


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def _inputs(rng, B, Sq, Sk, Hq, Hkv, D, Dv, dtype):
    q = rng.standard_normal((B, Sq, Hq, D)).astype(dtype)
    k = rng.standard_normal((B, Sk, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, Sk, Hkv, Dv)).astype(dtype)
    return q, k, v


def test_kernel_overwrites_poisoned_outputs_including_varlen_padding(cl_dev, rng):
    """Called below the API: out / lse start as NaN; rows past cu_seqlens_q[-1] must become 0 / -inf."""
    import pyopencl.array as cla

    from portakern.ir.ops import Attention, KVLayout
    dev, queue = cl_dev
    be = portakern.api.registry().get("opencl")
    op = Attention(batch=2, seqlen_q=10, seqlen_k=12, heads_q=2, heads_kv=1, head_dim=8, head_dim_v=8,
                   dtype="float32", scale=0.3, kv_layout=KVLayout.VARLEN, total_q=10, total_k=12, return_lse=True)
    kernel = be.compile(op, dev)
    q = to_cl(queue, rng.standard_normal((10, 2, 8)).astype(np.float32))
    k = to_cl(queue, rng.standard_normal((12, 1, 8)).astype(np.float32))
    v = to_cl(queue, rng.standard_normal((12, 1, 8)).astype(np.float32))
    out, lse = cla.empty(queue, (10, 2, 8), np.float32), cla.empty(queue, (2, 10), np.float32)
    out.fill(np.float32(np.nan))
    lse.fill(np.float32(np.nan))
    aux = {"cu_seqlens_q": to_cl(queue, np.array([0, 3, 7], np.int32)),
           "cu_seqlens_k": to_cl(queue, np.array([0, 5, 12], np.int32))}
    kernel(q, k, v, out, lse, aux)
    o, l = out.get(), lse.get()
    assert not np.isnan(o).any() and not np.isnan(l).any()
    assert np.all(o[7:] == 0) and np.all(np.isneginf(l[:, 7:])) and np.all(np.isfinite(l[:, :7]))


def test_dispatch_takes_the_cpu_reference_for_host_arrays_and_opencl_for_its_own(cl_dev, rng):
    """The backend's priority hook: host arrays without backend= stay on the cpu reference; pyopencl arrays run on
    opencl. (What every backend owes each array type is the contract suite's: tests/contract.)"""
    _, queue = cl_dev
    q, k, v = _inputs(rng, 1, 6, 11, 2, 1, 16, 16, np.float32)
    assert portakern.explain(portakern.attention, q, k, v).chosen == "cpu"
    assert portakern.explain(portakern.attention, to_cl(queue, q), to_cl(queue, k), to_cl(queue, v)).chosen == "opencl"
