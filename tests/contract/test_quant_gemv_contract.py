"""The quant_gemv contract, checked on every registered backend through ``portakern.quant_gemv(..., backend=name)``.

What every backend owes a caller: ``x @ dequant(W).T`` within the dtype's tolerance of a float64 product of the
codes, scales and zero points the test drew itself (packed by the IR's packer), in every packing; every output
element written (outputs NaN-poisoned first); a result of x's array type, device and dtype; the ``silu_mul``
prologue (``silu(gate) * up`` of ``x = [gate | up]``) where the backend lists it; x rows at any stride; an empty
batch as an empty result; bad input refused with a specific error. Unsupported problems skip with the backend's
own reason (``supports()``, asked through ``portakern.explain``).
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir.packing import pack
from portakern.quantized import QuantizedWeight

from contract_reference import gemv64, silu_mul64
from contract_targets import RTOL_GEMV, host, poisoned, skip_unless_supported

pytestmark = pytest.mark.contract

#: (packing, bits, symmetric, has_g_idx)
FORMATS = {"native4s": (Packing.NATIVE, 4, True, False), "native4a": (Packing.NATIVE, 4, False, False),
           "native8s": (Packing.NATIVE, 8, True, False), "native8a": (Packing.NATIVE, 8, False, False),
           "awq": (Packing.AWQ, 4, False, False), "gptq": (Packing.GPTQ, 4, False, False),
           "gptq-gidx": (Packing.GPTQ, 4, False, True), "q4_0": (Packing.GGUF_Q4_0, 4, True, False),
           "q8_0": (Packing.GGUF_Q8_0, 8, True, False)}


def make_weight(name, N, K, G, scale_dtype="float16", seed=0):
    """A packed ``QuantizedWeight`` (on the host) and the float64 ``W (N, K)`` it stores, from codes, scales and
    zero points drawn here."""
    rng = np.random.default_rng(seed)
    packing, bits, sym, gidx = FORMATS[name]
    fmt = QuantFormat(bits, G, sym, packing, scale_dtype=DType(scale_dtype), has_g_idx=gidx)
    ng = K // G
    codes = rng.integers(-128, 128, (N, K)) if packing is Packing.GGUF_Q8_0 else rng.integers(0, 1 << bits, (N, K))
    scales = rng.integers(1, 64, (N, ng)) / 1024.0              # exact in float16, bfloat16 and float32
    if sym:
        zeros, z = None, np.full((N, ng), float(fmt.zero_point))
    else:
        zeros = rng.integers(1 if packing is Packing.GPTQ else 0, 16 if bits == 4 else 256, (N, ng))
        z = zeros.astype(np.float64)
    g_idx = rng.permutation(np.arange(K) // G).astype(np.int32) if gidx else None
    group = g_idx.astype(np.int64) if gidx else np.arange(K) // G
    w64 = (codes - z[:, group]) * scales[:, group]
    return QuantizedWeight(fmt, N, K, pack(fmt, codes, scales, zeros, N, K, g_idx)), w64


def run(target, dtype, x, w, prologue=None):
    """``portakern.quant_gemv`` of numpy ``x`` (cast to ``dtype``) and host weight ``w`` on ``target``, forced to its
    backend, outputs poisoned: skips if unsupported; checks the result's array type, device, dtype and shape and
    that every element was written. Returns x as the backend received it and the result, as float64 numpy."""
    xd, wd = target.array(x, dtype), target.weight(w)
    skip_unless_supported(portakern.quant_gemv, xd, wd, prologue=prologue, backend=target.backend)
    with poisoned():
        out = portakern.quant_gemv(xd, wd, prologue=prologue, backend=target.backend)
    target.check_like(out, dtype, (x.shape[0], w.N))
    y = host(out)
    assert not np.isnan(y).any(), f"{int(np.isnan(y).sum())} output elements unwritten (still NaN) or NaN"
    return host(xd), y


def close(got, want, dtype, what=""):
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err <= RTOL_GEMV[dtype], f"{what} max |out - float64| / max |ref| = {err:.3g} > {RTOL_GEMV[dtype]}"


# -- every packing, dtype and batch ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_every_packing_matches_float64(target, name):
    N, K, G = (40, 320, 32) if name.startswith("q") else (48, 384, 64)
    w, w64 = make_weight(name, N, K, G, seed=1)
    x, y = run(target, "float16", np.random.default_rng(2).standard_normal((3, K)), w)
    close(y, gemv64(x, w64), "float16", name)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
def test_every_dtype_and_batch_matches_float64(target, dtype, M):
    w, w64 = make_weight("native4a", 24, 256, 64, seed=3)
    x, y = run(target, dtype, np.random.default_rng(M).standard_normal((M, 256)), w)
    close(y, gemv64(x, w64), dtype)


@pytest.mark.parametrize("name, G, K", [("native4a", 200, 200), ("native8s", 6, 96), ("awq", 32, 4096),
                                      ("gptq-gidx", 128, 256)],
                         ids=["one-group-spans-K", "group-of-6", "long-K", "act-order"])
def test_group_layouts_match_float64(target, name, G, K):
    w, w64 = make_weight(name, 16, K, G, seed=4)
    x, y = run(target, "float32", np.random.default_rng(5).standard_normal((1, K)), w)
    close(y, gemv64(x, w64), "float32", name)


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
def test_scale_dtypes_match_float64(target, scale_dtype):
    w, w64 = make_weight("native8a", 24, 192, 64, scale_dtype=scale_dtype, seed=6)
    x, y = run(target, "float32", np.random.default_rng(7).standard_normal((2, 192)), w)
    close(y, gemv64(x, w64), "float32")


# -- the silu_mul prologue --------------------------------------------------------------------------------

def test_silu_mul_prologue_matches_float64(target, dtype):
    """Gates far out in both tails included (where a naive ``exp(-gate)`` overflows)."""
    w, w64 = make_weight("gptq-gidx", 32, 256, 32, seed=8)
    x = 3 * np.random.default_rng(9).standard_normal((5, 512))
    x[0, 0], x[1, 1] = -60.0, 60.0
    xs, y = run(target, dtype, x, w, prologue="silu_mul")
    close(y, gemv64(silu_mul64(xs, 256), w64), dtype, "silu_mul")


# -- array types, strides, empty batches ------------------------------------------------------------------

def test_results_are_of_the_inputs_array_type_device_and_dtype(target_lib, dtype):
    w, w64 = make_weight("awq", 16, 128, 32, seed=10)
    x, y = run(target_lib, dtype, np.random.default_rng(11).standard_normal((3, 128)), w)
    close(y, gemv64(x, w64), dtype)


def test_x_rows_at_any_stride_give_the_results_of_their_values(target):
    """x is every other row of a wider buffer, columns padded: its rows are 2 * (K + 8) elements apart."""
    w, w64 = make_weight("native4s", 24, 128, 32, seed=12)
    buf = np.random.default_rng(13).standard_normal((6, 136)).astype(np.float32)
    x = target.array(buf, "float32")[::2, :128]
    skip_unless_supported(portakern.quant_gemv, x, target.weight(w), backend=target.backend)
    with poisoned():
        out = portakern.quant_gemv(x, target.weight(w), backend=target.backend)
    target.check_like(out, "float32", (3, 24))
    close(host(out), gemv64(buf[::2, :128], w64), "float32")


@pytest.mark.parametrize("prologue", [None, "silu_mul"])
def test_an_empty_batch_gives_an_empty_result_of_the_inputs_kind(target_lib, dtype, prologue):
    w, _ = make_weight("native4a", 8, 64, 32, seed=14)
    width = 128 if prologue else 64
    wd = target_lib.weight(w)
    skip_unless_supported(portakern.quant_gemv, target_lib.array(np.ones((1, width)), dtype), wd, prologue=prologue,
                          backend=target_lib.backend)
    out = portakern.quant_gemv(target_lib.array(np.zeros((0, width)), dtype), wd, prologue=prologue,
                               backend=target_lib.backend)
    target_lib.check_like(out, dtype, (0, 8))


# -- bad input is refused before any kernel --------------------------------------------------------------

def test_bad_input_is_refused_with_the_same_specific_error_on_every_backend(target):
    w, _ = make_weight("native4a", 16, 64, 32, seed=15)
    wd = target.weight(w)
    cases = [
        (lambda: portakern.quant_gemv(target.array(np.zeros((2, 48)), "float32"), wd, backend=target.backend),
         portakern.InvalidInputError, "x has K=48 columns but w is (16, 64): x must be (M, 64)"),
        (lambda: portakern.quant_gemv(target.array(np.zeros((2, 64), np.int32)), wd, backend=target.backend),
         portakern.InvalidTypeError, "x has dtype int32: activations must be float16, bfloat16 or float32"),
        (lambda: portakern.quant_gemv(target.array(np.zeros((2, 64)), "float32"), wd, prologue="gelu",
                                      backend=target.backend),
         portakern.InvalidInputError, "prologue='gelu' is not a quant_gemv prologue: use None or one of 'silu_mul'"),
        (lambda: portakern.quant_gemv(target.array(np.zeros((2, 64)), "float32"), np.zeros((16, 64), np.float32),
                                      backend=target.backend),
         portakern.InvalidTypeError, "expected a portakern.QuantizedWeight"),
    ]
    for call, exc, fragment in cases:
        with pytest.raises(exc) as info:
            call()
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
        assert isinstance(info.value, ValueError if exc is portakern.InvalidInputError else TypeError)
