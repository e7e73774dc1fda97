"""GGUF K-quants (Q4_K, Q5_K, Q6_K) on the triton and triton-rocm GEMV: the prepared layout and the kernels' minimums.

The repack (``portakern.gemv_kquants``: numpy on the host, torch ops for torch tensors) is compared bit for bit
between its two paths and against gguf-py's dequantizer; the table's choices are checked to keep K-quant weights on
the kernels that subtract the minimum ("fma", "dot"). Tests marked ``interpreter`` run the kernels under Triton's
CPU interpreter (TRITON_INTERPRET=1, scripts/test.sh's interpreter step) and compare every output, written over a
NaN-filled buffer, with float64 ``x @ W.T`` where W is gguf-py's dequantization of the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemv_cases import TOL, forced_config, reference_input

from portakern.devices import CPU, Device
from portakern.errors import InvalidInputError
from portakern.ir import DType, QuantGemv
from portakern.ir import gguf_kquants as KQ
from portakern.ir.quant import Packing, QuantFormat
from portakern.quantized import QuantizedWeight

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

KINDS = ("Q4_K", "Q5_K", "Q6_K")


def kquant_weight(kind: str, N: int, K: int, seed: int = 0, as_torch: bool = False) -> QuantizedWeight:
    """A ``QuantizedWeight`` of ``kind`` quantized from a random weight with both signs (so minimums are non-zero)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)) * 0.05 + rng.uniform(-0.02, 0.02, (N, 1))
    data = KQ.quantize(Packing(f"gguf_{kind.lower()}"), w)
    return QuantizedWeight.from_gguf(torch.from_numpy(data) if as_torch else data, kind, (N, K))


def gguf_dequant(weight: QuantizedWeight) -> np.ndarray:
    """gguf-py's dequantization of the weight's bytes, in float64 (its float32 values are exact there)."""
    data = np.asarray(weight.tensors["data"])
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[weight.fmt.packing.value[5:].upper()]) \
        .astype(np.float64).reshape(weight.N, weight.K)


# -- the prepared layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_torch_repack_is_bit_exact_to_numpy_and_holds_ggufs_values(kind):
    from portakern import gemv_kquants
    from portakern.gemv_weight import dequantize_prepared, prepare_gemv_weight

    N, K = 37, 768
    host = kquant_weight(kind, N, K, seed=3)
    ref = KQ.gemv_parts(host.fmt.packing, host.tensors["data"], N, K)
    got = gemv_kquants.parts_torch(host.fmt.packing, torch.from_numpy(host.tensors["data"]), N, K)
    assert got["bits"] == ref["bits"] == KQ.GEMV_BITS[host.fmt.packing] and got["zero_point"] == ref["zero_point"]
    np.testing.assert_array_equal(got["codes"].numpy(), ref["codes"])
    np.testing.assert_array_equal(got["scales"].numpy().view(np.uint32), ref["scales"].view(np.uint32))
    assert (got["mins"] is None) == (ref["mins"] is None) == (kind == "Q6_K")
    if ref["mins"] is not None:
        np.testing.assert_array_equal(got["mins"].numpy().view(np.uint32), ref["mins"].view(np.uint32))
    # the two prepare paths give the same tensors, and those hold gguf-py's weight exactly
    a = prepare_gemv_weight(host, CPU)
    b = prepare_gemv_weight(kquant_weight(kind, N, K, seed=3, as_torch=True), CPU)
    assert a.tensors().keys() == b.tensors().keys() and a.key() == b.key()
    for name, t in a.tensors().items():
        assert t.dtype == b.tensors()[name].dtype and torch.equal(t, b.tensors()[name]), name
    assert a.scales.dtype == torch.float32 and a.zeros is None and a.has_mins == (kind != "Q6_K")
    np.testing.assert_array_equal(dequantize_prepared(a).astype(np.float32), gguf_dequant(host).astype(np.float32))


def test_parts_keep_extreme_fields_exact():
    """Every 6-bit scale and minimum, codes 0 and 2^bits - 1, and float16 super-scales from subnormal to large."""
    N, K = 8, 512
    rng = np.random.default_rng(5)
    d = np.array([6e-8, 1e-5, 3e-3, 0.5, 7.0, 100.0, 2e-4, 0.0])[:, None].repeat(2, 1)
    for packing in (Packing.GGUF_Q4_K, Packing.GGUF_Q5_K, Packing.GGUF_Q6_K):
        bits, sub = KQ.LAYOUT[packing]
        fields = {"d": d, "q": rng.integers(0, 1 << bits, (N, K)), "sc": rng.integers(0, 64, (N, 2, 256 // sub))}
        fields["q"][:, :2] = [0, (1 << bits) - 1]
        if packing is Packing.GGUF_Q6_K:
            fields["sc"] = rng.integers(-128, 128, (N, 2, 16))
        else:
            fields.update(dmin=d[::-1], m=rng.integers(0, 64, (N, 2, 8)))
        data = KQ.pack_fields(packing, fields, N, K)
        from portakern import gemv_kquants

        p = gemv_kquants.parts_torch(packing, torch.from_numpy(data), N, K)
        ref = KQ.gemv_parts(packing, data, N, K)
        _, scales, zeros, mins = KQ.affine(packing, data, N, K)
        np.testing.assert_array_equal(ref["scales"].astype(np.float64), scales)      # exact in float32
        np.testing.assert_array_equal(p["scales"].numpy(), ref["scales"])
        if ref["mins"] is not None:
            np.testing.assert_array_equal(ref["mins"].astype(np.float64), mins)
            np.testing.assert_array_equal(p["mins"].numpy(), ref["mins"])


# -- which kernels serve them ---------------------------------------------------------------------------

def _op(kind: str, M: int, N: int, K: int, dtype=DType.bfloat16, prologue=None) -> QuantGemv:
    fmt = QuantFormat(*{"Q4_K": (4, 32, False), "Q5_K": (5, 32, False), "Q6_K": (6, 16, True)}[kind],
                      packing=Packing(f"gguf_{kind.lower()}"))
    return QuantGemv(M, N, K, dtype, fmt, prologue=prologue)


@pytest.mark.parametrize("kind", KINDS)
def test_tables_keep_kquants_on_the_kernels_that_read_them(kind):
    from portakern.backends.triton.quant_gemv.aot import LayoutStub
    from portakern.backends.triton.quant_gemv.autotune import bucket, candidates
    from portakern.backends.triton.quant_gemv.config import choose

    for N, K in ((4096, 4096), (28672, 8192), (77, 256)):
        lay = LayoutStub(_op(kind, 1, N, K))
        assert lay.bits == (4 if kind == "Q4_K" else 8) and lay.has_mins == (kind != "Q6_K") and lay.frag is None
        for arch in ("sm_80", "sm_90", "sm_100", "interp"):
            for M in (1, 2, 4, 16):
                assert choose(lay, M, N, arch).kind in ("fma", "dot"), (arch, M, N)
        for M in (1, 16):   # what PORTAKERN_TRITON_AUTOTUNE=1 would time
            assert {c.kind for c in candidates(lay, M, N, "sm_90", 132)} <= {"fma", "dot"}, (M, N)
    assert ("-mn1" in bucket(LayoutStub(_op(kind, 1, 64, 256)), 1, 64, "bfloat16")) == (kind != "Q6_K")


@pytest.mark.parametrize("kind", ["mma", "stream"])
def test_forced_kernels_without_minimums_refuse_q4_k(kind):
    from portakern.backends.triton.quant_gemv.aot import LayoutStub
    from portakern.backends.triton.quant_gemv.config import GemvConfig, fit

    M = 1 if kind == "stream" else 16
    lay = LayoutStub(_op("Q4_K", M, 8192, 4096))
    with pytest.raises(ValueError, match=f"GemvConfig\\(kind='{kind}'\\) cannot serve this weight: a float minimum "
                                         "per group"):
        fit(GemvConfig(kind, 64, 16), lay, M)


@pytest.mark.parametrize("name, served", [("cuda", "served by triton on NVIDIA GPUs"),
                                          ("torch", "served by triton on NVIDIA GPUs, triton-rocm on AMD GPUs")])
@pytest.mark.parametrize("kind", KINDS)
def test_backends_without_a_kquant_kernel_name_the_ones_that_serve_it(name, served, kind):
    from portakern.backends.cuda import quant_gemv as cuda_gemv

    mod = cuda_gemv if name == "cuda" else pytest.importorskip("portakern.backends.torch.quant_gemv")
    why = mod.supports(_op(kind, 1, 4096, 4096), Device("cuda", 0, arch="sm_90", capability=(9, 0)))
    assert not why and f"quant_gemv(packing=gguf_{kind.lower()}) is not supported by {name}" in why.reason
    assert served in why.reason and "backend='cpu'" in why.reason


@pytest.mark.parametrize("backend", ["triton", "triton_rocm"])
def test_a_weight_of_another_kquant_is_refused_before_launch(backend):
    """A prepared Q5_K weight (8-bit words) given to a kernel compiled for a Q4_K op of the same shape."""
    import importlib

    from portakern.gemv_weight import prepare_gemv_weight

    mod = importlib.import_module(f"portakern.backends.{backend}.quant_gemv")
    kern = mod.compile(_op("Q4_K", 1, 40, 512, DType.float32), CPU)
    prepared = prepare_gemv_weight(kquant_weight("Q5_K", 40, 512), CPU)
    with pytest.raises(InvalidInputError, match=r"prepared weight has bits = 8 but this quant_gemv op was compiled "
                                                r"for 4; prepare the weight of this op"):
        kern(torch.zeros((1, 512)), prepared, torch.empty((1, 40)))


# -- values under the interpreter ---------------------------------------------------------------------------

#: (kind, M, N, K, x dtype, forced config of gemv_cases.forced_config or None, prologue)
CASES = [
    ("Q4_K", 1, 77, 768, "float32", None, None),
    ("Q4_K", 2, 40, 512, "float16", None, None),                           # fma, two rows (the interpreter table)
    ("Q4_K", 5, 33, 256, "bfloat16", None, None),                          # dot
    ("Q4_K", 16, 64, 512, "float32", None, None),
    ("Q4_K", 1, 40, 1024, "float32", ("fma", 8, 8, 4, 3), None),           # split-K, subnormal codes
    ("Q4_K", 1, 200, 512, "float16", ("fma", 128, 16, 1, 3, {"group_rows": True}), None),
    ("Q4_K", 16, 48, 512, "float16", ("dot", 16, 16, 2, 2, True), None),   # swapped operands, split-K
    ("Q4_K", 3, 40, 512, "float32", None, "silu_mul"),
    ("Q5_K", 1, 77, 768, "float16", None, None),
    ("Q5_K", 2, 40, 512, "float32", ("fma", 16, 16, 2, 3), None),
    ("Q5_K", 1, 130, 512, "float32", ("fma", 128, 8, 1, 3, {"group_rows": True}), None),
    ("Q5_K", 16, 33, 256, "bfloat16", None, None),
    ("Q6_K", 1, 77, 768, "bfloat16", None, None),
    ("Q6_K", 2, 40, 512, "float32", ("fma", 8, 8, 2, 3), None),
    ("Q6_K", 16, 64, 512, "float16", None, None),
]


def _x(M: int, width: int, dtype: str, seed: int = 1):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((M, width)).astype(np.float32)).to(getattr(torch, dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=["-".join(str(v) for v in c[:5]) + ("-forced" if c[5] else "")
                                              + (f"-{c[6]}" if c[6] else "") for c in CASES])
def test_triton_matches_ggufs_weight_in_float64(case):
    import portakern
    from portakern.backends.triton import quant_gemv as Q
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.validate import quant_gemv_op

    kind, M, N, K, dt, cfg, prologue = case
    w = kquant_weight(kind, N, K, seed=M)
    x = _x(M, 2 * K if prologue else K, dt)
    ref = reference_input(x.double().numpy(), prologue, K) @ gguf_dequant(w).T
    if cfg is None:
        with portakern.dispatch.poison_outputs():                         # outputs start as NaN
            y = portakern.quant_gemv(x, w, prologue=prologue, backend="triton")
    else:
        op, _ = quant_gemv_op(x, w, prologue)
        kern = Q.compile(op, CPU, forced_config(cfg, num_warps=1))
        y = torch.full((M, N), float("nan"), dtype=x.dtype)
        prepared = prepare_gemv_weight(w, CPU)
        for _ in range(2):                                                # split-K counters reset themselves
            kern(x, prepared, y)
        assert {ln.cfg.kind for ln in kern.launchers.values()} == {cfg[0]}
    y = y.double().numpy()
    assert not np.isnan(y).any(), f"{int(np.isnan(y).sum())} outputs left unwritten (NaN)"
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= TOL[dt], f"max|out - float64| / max|ref| = {err:.3g} > {TOL[dt]}"


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M, dt", [(1, "float16"), (16, "float32"), (4, "bfloat16")])
def test_triton_rocm_matches_ggufs_weight_in_float64(kind, M, dt):
    import portakern

    N, K = 45, 512
    w = kquant_weight(kind, N, K, seed=7, as_torch=M == 16)               # both prepare paths
    x = _x(M, K, dt, seed=M)
    with portakern.dispatch.poison_outputs():
        y = portakern.quant_gemv(x, w, backend="triton-rocm").double().numpy()
    ref = x.double().numpy() @ gguf_dequant(w).T
    assert not np.isnan(y).any()
    assert np.abs(y - ref).max() / np.abs(ref).max() <= TOL[dt]


@pytest.mark.parametrize("kind", KINDS)
def test_torch_ops_refuse_kquants_rather_than_drop_the_minimums(kind):
    """``torch.ops.portakern.quant_gemv``'s signature carries no minimums: its wrappers refuse a K-quant weight (and
    its prepared copy) instead of computing without them."""
    from portakern import torch_ops
    from portakern.errors import UnsupportedError
    from portakern.gemv_weight import prepare_gemv_weight

    w = kquant_weight(kind, 16, 256)
    p = prepare_gemv_weight(w, CPU)
    for arg in (w, p) if p.has_mins else (w,):
        with pytest.raises(UnsupportedError, match=r"take no GGUF K-quant weight .* call portakern.quant_gemv\(x, "
                                                   r"weight\)"):
            torch_ops.quant_linear(torch.zeros((1, 256)), arg)
    with pytest.raises(UnsupportedError, match="take no GGUF K-quant weight"):
        torch_ops.QuantLinear(w)
    if not p.has_mins:   # Q6_K's prepared copy is codes, scales and a fixed zero point: the CPU path computes it
        x = _x(2, 256, "float32")
        ref = x.double().numpy() @ gguf_dequant(w).T
        np.testing.assert_allclose(torch_ops.quant_linear(x, p).double().numpy(), ref, rtol=0, atol=1e-5)
