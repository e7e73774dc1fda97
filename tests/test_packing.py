"""The numpy reference packers (portakern.ir.packing) against independent references.

References: literal words worked out by hand from the layouts on ``portakern.ir.Packing``, a
per-nibble bit computation written here from scratch, and gguf-py's own quantizer/dequantizer.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import packing as P

gguf = pytest.importorskip("gguf")

FORMATS = {
    "native4_asym_g32": QuantFormat(4, 32, False),
    "native4_sym_g64": QuantFormat(4, 64, True),
    "native8_asym_g32": QuantFormat(8, 32, False),
    "native8_sym_g128": QuantFormat(8, 128, True),
    "native4_asym_bf16": QuantFormat(4, 32, False, scale_dtype=DType.bfloat16),
    "native4_sym_fp32": QuantFormat(4, 32, True, scale_dtype=DType.float32),
    "awq_g32": QuantFormat(4, 32, False, Packing.AWQ),
    "gptq_g64": QuantFormat(4, 64, False, Packing.GPTQ),
    "gptq_g32_gidx": QuantFormat(4, 32, False, Packing.GPTQ, has_g_idx=True),
    "gguf_q4_0": QuantFormat(4, 32, True, Packing.GGUF_Q4_0),
    "gguf_q8_0": QuantFormat(8, 32, True, Packing.GGUF_Q8_0),
}


def random_unpacked(fmt: QuantFormat, N: int, K: int, seed: int):
    """Random codes/scales/zeros/g_idx valid for ``fmt``; scales exact in the scale dtype."""
    rng = np.random.default_rng(seed)
    ng = K // fmt.group_size
    if fmt.packing is Packing.GGUF_Q8_0:
        codes = rng.integers(-128, 128, (N, K))
    else:
        codes = rng.integers(0, 1 << fmt.bits, (N, K))
    scales = rng.uniform(-2, 2, (N, ng)).astype(np.float16).astype(np.float64)  # GGUF d may be < 0
    if fmt.scale_dtype is DType.bfloat16:  # round to bf16-exact values
        scales = P._store_scales(scales, DType.bfloat16).astype(np.float64)
    zeros = None
    if not fmt.symmetric:
        lo, hi = (1, 16) if fmt.packing is Packing.GPTQ else (0, (1 << fmt.bits) - 1)
        zeros = rng.integers(lo, hi + 1, (N, ng))
    g_idx = None
    if fmt.has_g_idx:
        g_idx = (np.arange(K) // fmt.group_size)[rng.permutation(K)]
    return codes, scales, zeros, g_idx


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_trip_pack_unpack(name):
    fmt = FORMATS[name]
    N, K = 16, 256
    codes, scales, zeros, g_idx = random_unpacked(fmt, N, K, seed=1)
    tensors = P.pack(fmt, codes, scales, zeros, N, K, g_idx=g_idx)
    P.validate_tensors(fmt, tensors, N, K)
    c2, s2, z2, g2 = P.unpack(fmt, tensors, N, K)
    assert c2.dtype == np.int64 and s2.dtype == np.float64 and z2.dtype == np.float64 and g2.dtype == np.int64
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(s2, scales)
    np.testing.assert_array_equal(z2, zeros if zeros is not None else np.full_like(s2, fmt.zero_point))
    np.testing.assert_array_equal(g2, g_idx if g_idx is not None else np.arange(K) // fmt.group_size)
    # and the other way: pack(unpack(t)) reproduces the bytes
    again = P.pack(fmt, c2, s2, None if fmt.symmetric else z2.astype(int), N, K,
                   g_idx=g2 if fmt.has_g_idx else None)
    assert again.keys() == tensors.keys()
    for k in tensors:
        assert again[k].dtype == tensors[k].dtype
        np.testing.assert_array_equal(again[k].view(np.uint8), tensors[k].view(np.uint8))


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_matches_elementwise_formula(name):
    fmt = FORMATS[name]
    N, K = 8, 64 if fmt.group_size <= 64 else 128
    codes, scales, zeros, g_idx = random_unpacked(fmt, N, K, seed=2)
    out = P.dequantize(fmt, P.pack(fmt, codes, scales, zeros, N, K, g_idx=g_idx), N, K)
    for n in range(N):
        for k in range(K):
            g = g_idx[k] if g_idx is not None else k // fmt.group_size
            z = zeros[n, g] if zeros is not None else fmt.zero_point
            assert out[n, k] == (codes[n, k] - z) * scales[n, g]


# -- hand-worked words ---------------------------------------------------------------------------

def to_int32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def test_native4_byte_order_literal():
    fmt = QuantFormat(4, 2, True)
    t = P.pack(fmt, np.array([[1, 2, 15, 0]]), np.ones((1, 2)), None, 1, 4)
    assert t["qweight"].tolist() == [[0x21, 0x0F]]  # k = 2j low nibble, k = 2j + 1 high nibble


def test_awq_word_literal():
    # W[n, 0] = n for n = 0..7: nibble i holds channel ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i]
    fmt = QuantFormat(4, 2, False, Packing.AWQ)
    codes = np.zeros((8, 2), dtype=int)
    codes[:, 0] = np.arange(8)
    t = P.pack(fmt, codes, np.ones((8, 1)), np.full((8, 1), 3), 8, 2)
    assert t["qweight"].dtype == np.int32 and t["qweight"].shape == (2, 1)
    assert t["qweight"][0, 0] == to_int32(0x75316420)
    assert t["qweight"][1, 0] == 0
    assert t["qzeros"][0, 0] == to_int32(0x33333333)  # AWQ zeros are stored as they are


def test_gptq_words_literal():
    # W[n, k] = k: word [0, n] holds k = 0..7 in nibbles 0..7; v1 qzeros hold zero - 1
    fmt = QuantFormat(4, 8, False, Packing.GPTQ)
    codes = np.tile(np.arange(8), (8, 1))
    zeros = np.arange(1, 9).reshape(8, 1)  # z[n] = n + 1 -> stored n
    t = P.pack(fmt, codes, np.ones((8, 1)), zeros, 8, 8)
    assert t["qweight"].shape == (1, 8) and (t["qweight"] == to_int32(0x76543210)).all()
    assert t["qzeros"].shape == (1, 1) and t["qzeros"][0, 0] == to_int32(0x76543210)
    t8 = P.pack(fmt, codes, np.ones((8, 1)), np.full((8, 1), 8), 8, 8)
    assert t8["qzeros"][0, 0] == 0x77777777  # the familiar symmetric GPTQ checkpoint word


def hand_awq_words(vals_kn: np.ndarray) -> np.ndarray:
    """(R, C) -> int32 (R, C // 8), written independently: nibble i <- column 8j + order[i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    R, C = vals_kn.shape
    out = np.zeros((R, C // 8), dtype=np.int64)
    for r in range(R):
        for j in range(C // 8):
            word = 0
            for i in range(8):
                word |= int(vals_kn[r, 8 * j + order[i]]) << (4 * i)
            out[r, j] = to_int32(word)
    return out.astype(np.int32)


def hand_gptq_qweight(codes_nk: np.ndarray) -> np.ndarray:
    """(N, K) -> int32 (K // 8, N): word [r, n] nibble i <- W[n, 8r + i]."""
    N, K = codes_nk.shape
    out = np.zeros((K // 8, N), dtype=np.int64)
    for r in range(K // 8):
        for n in range(N):
            out[r, n] = to_int32(sum(int(codes_nk[n, 8 * r + i]) << (4 * i) for i in range(8)))
    return out.astype(np.int32)


def test_awq_pack_matches_hand_bits():
    fmt = FORMATS["awq_g32"]
    codes, scales, zeros, _ = random_unpacked(fmt, 16, 64, seed=3)
    t = P.pack(fmt, codes, scales, zeros, 16, 64)
    np.testing.assert_array_equal(t["qweight"], hand_awq_words(codes.T))
    np.testing.assert_array_equal(t["qzeros"], hand_awq_words(zeros.T))
    np.testing.assert_array_equal(t["scales"], scales.T.astype(np.float16))


def test_gptq_pack_matches_hand_bits_zero_minus_one():
    fmt = FORMATS["gptq_g64"]
    codes, scales, zeros, _ = random_unpacked(fmt, 16, 128, seed=4)
    t = P.pack(fmt, codes, scales, zeros, 16, 128)
    np.testing.assert_array_equal(t["qweight"], hand_gptq_qweight(codes))
    stored = (zeros - 1) & 0xF
    ident = np.array([[int(sum(int(stored[8 * j + i, g]) << (4 * i) for i in range(8)))
                       for j in range(2)] for g in range(2)], dtype=np.int64)
    np.testing.assert_array_equal(t["qzeros"].astype(np.int64) & 0xFFFFFFFF, ident)


# -- GGUF against gguf-py ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,packing,bits", [("Q4_0", Packing.GGUF_Q4_0, 4), ("Q8_0", Packing.GGUF_Q8_0, 8)])
def test_gguf_matches_gguf_py_exactly(qtype, packing, bits):
    T = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(5).standard_normal((12, 320)).astype(np.float32) * 3
    w[0, :32] = 0  # an all-zero block (d = 0)
    data = gguf.quants.quantize(w, T)
    fmt = QuantFormat(bits, 32, True, packing)
    ours = P.dequantize(fmt, {"data": data}, 12, 320)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, T).astype(np.float64))
    codes, scales, zeros, _ = P.unpack(fmt, {"data": data}, 12, 320)
    np.testing.assert_array_equal(P.pack(fmt, codes, scales, None, 12, 320)["data"], data)


# -- properties ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(list(FORMATS)), rows=st.integers(1, 3), groups=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_round_trip_property(name, rows, groups, seed):
    fmt = FORMATS[name]
    N, K = 8 * rows, fmt.group_size * groups
    codes, scales, zeros, g_idx = random_unpacked(fmt, N, K, seed)
    c, s, z, g = P.unpack(fmt, P.pack(fmt, codes, scales, zeros, N, K, g_idx=g_idx), N, K)
    assert np.array_equal(c, codes) and np.array_equal(s, scales)
    if zeros is not None:
        assert np.array_equal(z, zeros)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), sym=st.booleans(), G=st.sampled_from([2, 8, 32]),
       sd=st.sampled_from(["float16", "bfloat16", "float32"]), seed=st.integers(0, 2**31),
       mag=st.sampled_from([1e-6, 1.0, 300.0]), offset=st.sampled_from([0.0, 5.0]))
def test_quantize_native_error_bound_property(bits, sym, G, sd, seed, mag, offset):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((4, 4 * G)) * mag + offset * mag
    tensors, fmt = P.quantize_native(w, bits, G, sym, sd)
    _, scales, _, group = P.unpack(fmt, tensors, 4, 4 * G)
    err = np.abs(P.dequantize(fmt, tensors, 4, 4 * G) - w)
    assert (err <= scales[:, group] / 2 * (1 + 1e-12)).all()


def test_quantize_native_exact_zeros_and_bf16_scales():
    w = np.zeros((2, 64))
    w[1, 32:] = np.arange(32) * 0.125 - 1  # holds an exact 0.0 at index 8
    tensors, fmt = P.quantize_native(w, 4, 32, False, "bfloat16")
    assert tensors["scales"].dtype == np.float32
    assert (tensors["scales"].view(np.uint32) & 0xFFFF == 0).all()  # bf16-exact values
    deq = P.dequantize(fmt, tensors, 2, 64)
    assert (w == 0).sum() == 97 and (deq[w == 0] == 0).all()


# -- bad input -------------------------------------------------------------------------------------

def good_awq():
    fmt = FORMATS["awq_g32"]
    codes, scales, zeros, _ = random_unpacked(fmt, 16, 64, seed=6)
    return fmt, P.pack(fmt, codes, scales, zeros, 16, 64)


@pytest.mark.parametrize("mutate,exc,fragment", [
    (lambda t: t.update(qweight=t["qweight"].astype(np.float32)), InvalidTypeError, "stores it as int32"),
    (lambda t: t.update(qweight=t["qweight"][:-1]), InvalidInputError, "needs (K, N // 8) = (64, 2)"),
    (lambda t: t.pop("qzeros"), InvalidInputError, "missing ['qzeros']"),
    (lambda t: t.update(g_idx=np.zeros(64, np.int32)), InvalidInputError, "unexpected ['g_idx']"),
    (lambda t: t.update(scales=t["scales"][:1]), InvalidInputError, "that shape fits group_size=64"),
])
def test_validate_tensors_errors(mutate, exc, fragment):
    fmt, t = good_awq()
    mutate(t)
    with pytest.raises(exc) as info:
        P.dequantize(fmt, t, 16, 64)
    assert fragment in str(info.value)


def test_pack_and_quantize_errors():
    fmt = FORMATS["gptq_g32_gidx"]
    codes, scales, zeros, g_idx = random_unpacked(fmt, 8, 64, seed=7)
    with pytest.raises(InvalidInputError, match=r"g_idx\[3\]=2 is out of range.*\[0, 1\]"):
        P.pack(fmt, codes, scales, zeros, 8, 64, g_idx=np.where(np.arange(64) == 3, 2, g_idx))
    with pytest.raises(InvalidInputError, match="GPTQ v1 zero points .* must lie in \\[1, 16\\]"):
        P.pack(fmt, codes, scales, np.zeros_like(zeros), 8, 64, g_idx=g_idx)
    with pytest.raises(InvalidInputError, match=r"codes\[0, 0\]=16 is out of range"):
        P.pack(fmt, np.where(np.arange(64) == 0, 16, codes), scales, zeros, 8, 64, g_idx=g_idx)
    with pytest.raises(InvalidInputError, match="group_size=48 does not divide K=64"):
        P.quantize_native(np.ones((2, 64)), 4, 48, False)
    with pytest.raises(InvalidInputError, match="overflows scale_dtype=float16; pass scale_dtype='float32'"):
        P.quantize_native(np.full((1, 32), 1e6), 4, 32, True)
    with pytest.raises(InvalidInputError, match="must be finite"):
        P.quantize_native(np.array([[0.0, np.nan]]), 4, 2, True)


def _native(sym=False, N=4, K=64):
    fmt = FORMATS["native4_sym_g64" if sym else "native4_asym_g32"]
    codes, scales, zeros, _ = random_unpacked(fmt, N, K, seed=8)
    return fmt, codes, scales, zeros


@pytest.mark.parametrize("change, fragment", [
    (dict(codes=np.zeros((4, 63), np.int64)), r"codes has shape \(4, 63\) and dtype int64: it must be an integer "
                                              r"array of shape \(N, K\) = \(4, 64\)"),
    (dict(codes=np.zeros((4, 64))), r"codes has shape \(4, 64\) and dtype float64: it must be an integer array"),
    (dict(scales=np.ones((4, 3))), r"scales has shape \(4, 3\): it must be \(N, K // group_size\) = \(4, 2\)"),
    (dict(zeros=None), r"zeros=None but packing native is asymmetric: pass the integer zero points, "
                       r"shape \(N, K // group_size\) = \(4, 2\)"),
    (dict(zeros=np.full((4, 2), 1.5)), r"zeros has shape \(4, 2\): it must hold integers, shape \(N, K // group_size\)"),
    (dict(g_idx=np.zeros(64, np.int32)), r"g_idx was given but fmt.has_g_idx=False \(native\): drop it, "
                                          r"or use packing gptq with has_g_idx=True"),
], ids=["codes-shape", "codes-dtype", "scales-shape", "zeros-missing", "zeros-fractional", "g_idx-unexpected"])
def test_pack_argument_errors(change, fragment):
    fmt, codes, scales, zeros = _native()
    args = {"codes": codes, "scales": scales, "zeros": zeros, "g_idx": None, **change}
    with pytest.raises(InvalidInputError, match=fragment):
        P.pack(fmt, args["codes"], args["scales"], args["zeros"], 4, 64, g_idx=args["g_idx"])


def test_pack_symmetric_zero_points_and_missing_g_idx():
    fmt, codes, scales, _ = _native(sym=True)
    with pytest.raises(InvalidInputError, match=r"zeros must be None \(or all 8\) for a symmetric format: "
                                                r"native has the fixed zero point 8"):
        P.pack(fmt, codes, scales, np.full((4, 1), 7), 4, 64)
    P.pack(fmt, codes, scales, np.full((4, 1), 8), 4, 64)     # all equal to the fixed zero point: accepted
    gfmt = FORMATS["gptq_g32_gidx"]
    codes, scales, zeros, _ = random_unpacked(gfmt, 8, 64, seed=9)
    with pytest.raises(InvalidInputError, match=r"g_idx=None but fmt.has_g_idx=True: pass the \(K,\) group of "
                                                r"each input channel, or use a format with has_g_idx=False"):
        P.pack(gfmt, codes, scales, zeros, 8, 64)


def test_validate_tensors_rejects_a_non_array():
    fmt, t = good_awq()
    t["scales"] = t["scales"].tolist()
    with pytest.raises(InvalidTypeError, match=r"tensors\['scales'\] is a list: expected a numpy array, torch "
                                               r"tensor or cupy array"):
        P.validate_tensors(fmt, t, 16, 64)


def test_quantize_native_shape_and_bits():
    with pytest.raises(InvalidInputError, match=r"w has shape \(64,\): expected a 2-D weight \(N, K\) = "
                                                r"\(out, in features\)"):
        P.quantize_native(np.ones(64), 4, 32)
    with pytest.raises(InvalidInputError, match="bits=3 is not supported by the native packing: choose 4 or 8"):
        P.quantize_native(np.ones((2, 64)), 3, 32)
