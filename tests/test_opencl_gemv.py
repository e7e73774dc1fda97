"""The opencl backend's quantized GEMV internals on the OpenCL device (PoCL in CI): weights moved to the device, the
priority hook's choices, and devices that allow only small work-groups (its kernel and attention's, called below
the API). Every packing, M, dtypes, the silu_mul prologue, poisoned outputs and array kinds are the contract
suite's (tests/contract), run on this backend too, against float64 from the codes the test packed itself."""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern.ir.dtypes import DType
from portakern.ir.packing import pack
from portakern.ir.quant import Packing, QuantFormat
from portakern.quantized import QuantizedWeight

from opencl_helpers import require_opencl, to_cl

#: (packing, bits, symmetric, has_g_idx)
FORMATS = {"native4s": (Packing.NATIVE, 4, True, False), "native4a": (Packing.NATIVE, 4, False, False),
           "native8s": (Packing.NATIVE, 8, True, False), "native8a": (Packing.NATIVE, 8, False, False),
           "awq": (Packing.AWQ, 4, False, False), "gptq": (Packing.GPTQ, 4, False, False),
           "gptq-gidx": (Packing.GPTQ, 4, False, True), "q4_0": (Packing.GGUF_Q4_0, 4, True, False),
           "q8_0": (Packing.GGUF_Q8_0, 8, True, False)}


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def make_weight(rng, name, N, K, G, scale_dtype="float16"):
    """A packed weight and the float64 ``W (N, K)`` it stores, from codes / scales / zeros drawn here."""
    packing, bits, sym, gidx = FORMATS[name]
    fmt = QuantFormat(bits, G, sym, packing, scale_dtype=DType(scale_dtype), has_g_idx=gidx)
    ng = K // G
    if packing is Packing.GGUF_Q8_0:
        codes = rng.integers(-128, 128, (N, K))
    else:
        codes = rng.integers(0, 1 << bits, (N, K))
    scales = rng.integers(1, 64, (N, ng)) / 1024.0              # exact in float16, bfloat16 and float32
    if sym:
        zeros, z = None, np.full((N, ng), float(fmt.zero_point))
    else:
        lo = 1 if packing is Packing.GPTQ else 0
        zeros = rng.integers(lo, 16 if bits == 4 else 256, (N, ng))
        z = zeros.astype(np.float64)
    g_idx = rng.permutation(np.arange(K) // G).astype(np.int32) if gidx else None
    group = g_idx.astype(np.int64) if gidx else np.arange(K) // G
    w64 = (codes - z[:, group]) * scales[:, group]
    tensors = pack(fmt, codes, scales, zeros, N, K, g_idx)
    return QuantizedWeight(fmt, N, K, tensors), w64


def test_weights_move_to_the_device_and_dispatch_takes_opencl_for_its_arrays(cl_dev, rng):
    """A weight moved to the OpenCL device holds pyopencl arrays (and moves back to numpy); the priority hook keeps
    host arrays on the cpu reference and runs pyopencl arrays on opencl. (Values and array kinds are the contract
    suite's: tests/contract.)"""
    dev, queue = cl_dev
    w, _ = make_weight(rng, "awq", 16, 128, 32)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    wd = w.to(str(dev))
    assert wd.device == dev and type(wd.tensors["qweight"]).__module__.startswith("pyopencl")
    assert type(wd.to("cpu").tensors["qweight"]) is np.ndarray
    assert portakern.explain(portakern.quant_gemv, x, w).chosen == "cpu"
    assert portakern.explain(portakern.quant_gemv, to_cl(queue, x), wd).chosen == "opencl"


@pytest.mark.parametrize("cap", [1, 8])
def test_small_work_group_devices(cl_dev, rng, cap):
    """A device allowing only ``cap`` work-items per group: the GEMV shrinks its work-group and row block, the
    attention its row block (exercised on PoCL by describing the device with that cap)."""
    from dataclasses import replace

    from portakern.backends.opencl import attention as A
    from portakern.backends.opencl import quant_gemv as Q
    from portakern.ir.ops import Attention, QuantGemv

    dev, queue = cl_dev
    small = replace(dev, info=tuple((k, str(cap) if k == "max_work_group_size" else v) for k, v in dev.info))
    w, w64 = make_weight(rng, "native4a", 24, 128, 32)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    op = QuantGemv(11, 24, 128, DType.float32, w.fmt, prologue="silu_mul")
    out = cla_empty(queue, (11, 24))
    Q.compile(op, small)(to_cl(queue, x), Q.prepare_weight(w, dev), out)
    g, u = x[:, :128].astype(np.float64), x[:, 128:].astype(np.float64)
    np.testing.assert_allclose(out.get(), (g / (1 + np.exp(-g)) * u) @ w64.T, atol=1e-4)

    aop = Attention(batch=1, seqlen_q=9, seqlen_k=20, heads_q=4, heads_kv=2, head_dim=16, head_dim_v=16,
                    dtype=DType.float32, scale=0.25, return_lse=True)
    assert A.tiles(aop, cap)[0] == cap
    q, k = rng.standard_normal((1, 9, 4, 16)).astype(np.float32), rng.standard_normal((1, 20, 2, 16)).astype(np.float32)
    o, lse = cla_empty(queue, (1, 9, 4, 16)), cla_empty(queue, (1, 4, 9))
    A.compile(aop, small)(to_cl(queue, q), to_cl(queue, k), to_cl(queue, k), o, lse, {})
    from opencl_helpers import ref_attention

    ref, _ = ref_attention(q, k, k, scale=0.25)
    np.testing.assert_allclose(o.get(), ref, atol=2e-5)


def cla_empty(queue, shape):
    import pyopencl.array as cla

    a = cla.empty(queue, shape, np.float32)
    a.fill(np.float32(np.nan))
    return a
