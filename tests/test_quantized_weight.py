"""``QuantizedWeight`` constructors, dequantize, device moves, and ``portakern.quantize``.

Checkpoint tensors are built here with packers written independently of portakern (per-nibble
shifts from the layouts on ``portakern.ir.Packing``), and GGUF data comes from gguf-py itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from portakern.arrays import to_numpy
from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import packing as P
from portakern.quantize import quantize
from portakern.quantized import QuantizedWeight

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def words(vals: np.ndarray, order=range(8)) -> np.ndarray:
    """Pack (R, 8C) nibbles into int32 (R, C): nibble i of word j <- column 8j + order[i]."""
    order = list(order)
    R, C = vals.shape
    out = np.zeros((R, C // 8), dtype=np.uint32)
    for j in range(C // 8):
        for i in range(8):
            out[:, j] |= vals[:, 8 * j + order[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def checkpoint(N=32, K=256, G=64, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (N, K))
    zeros = rng.integers(1, 16, (N, K // G))
    scales = rng.uniform(0.001, 0.05, (N, K // G)).astype(np.float16)
    return codes, zeros, scales


def reference(codes, zeros, scales, group):
    return ((codes - zeros[:, group]) * scales.astype(np.float64)[:, group]).astype(np.float32)


# -- portakern.quantize --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_quantize_error_bound_per_group(bits, symmetric, lib):
    w = np.random.default_rng(1).standard_normal((24, 256)).astype(np.float32)
    w[3] += 4.0  # an all-positive row
    arg = torch.from_numpy(w) if lib == "torch" else w
    q = quantize(arg, bits=bits, group_size=64, symmetric=symmetric)
    assert q.fmt == QuantFormat(bits, 64, symmetric) and q.shape == (24, 256)
    assert all(type(t).__module__.split(".")[0] == lib for t in q.tensors.values())
    deq = q.dequantize()
    assert type(deq).__module__.split(".")[0] == lib and deq.dtype in (np.float32, torch.float32)
    scales = to_numpy(q.tensors["scales"]).astype(np.float64)  # (N, K // 64)
    err = np.abs(to_numpy(deq).astype(np.float64) - w).reshape(24, 4, 64).max(axis=-1)
    assert (err <= scales / 2 * (1 + 1e-6) + 1e-7).all()  # + the float32 rounding of dequant


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_keeps_library_and_device_bf16(device):
    w = torch.randn(16, 128, dtype=torch.bfloat16, device=device)
    q = quantize(w, group_size=-1, symmetric=True, scale_dtype="bfloat16")
    assert q.fmt.group_size == 128 and q.fmt.scale_dtype is DType.bfloat16
    assert q.tensors["scales"].dtype == torch.bfloat16 and str(q.device) == device
    assert set(q.tensors) == {"qweight", "scales"}
    assert q.nbytes == 16 * 64 + 16 * 2
    # a numpy backend's prepare_weight converts bf16 scales to float32: still a valid weight
    host = q.with_tensors({k: to_numpy(v) for k, v in q.tensors.items()})
    np.testing.assert_array_equal(host.dequantize(), q.dequantize().cpu().numpy())


def test_nbytes_and_repr():
    q = quantize(np.ones((16, 256), np.float32), bits=4, group_size=128)
    assert q.nbytes == 16 * 128 + 16 * 2 * 2 + 16 * 2  # qweight + fp16 scales + uint8 zeros
    assert "packing=native" in repr(q) and "device=cpu" in repr(q)


# -- checkpoint constructors ---------------------------------------------------------------------

def test_from_awq_dequantize():
    codes, zeros, scales = checkpoint()
    q = QuantizedWeight.from_awq(words(codes.T, AWQ_ORDER), words(zeros.T, AWQ_ORDER),
                                 np.ascontiguousarray(scales.T), group_size=64)
    assert (q.N, q.K, q.fmt.packing, q.fmt.scale_dtype) == (32, 256, Packing.AWQ, DType.float16)
    np.testing.assert_array_equal(q.dequantize(), reference(codes, zeros, scales, np.arange(256) // 64))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_from_gptq_v1_zero_plus_one(lib):
    codes, zeros, scales = checkpoint(seed=2)
    qweight = words(codes).T.copy()            # (K // 8, N), nibbles along K
    qzeros = words((zeros - 1).T)              # v1: zero - 1, nibbles along N
    args = [qweight, qzeros, np.ascontiguousarray(scales.T)]
    if lib == "torch":
        args = [torch.from_numpy(a) for a in args]
    q = QuantizedWeight.from_gptq(*args, group_size=64)
    assert not q.fmt.has_g_idx and "g_idx" not in q.tensors
    np.testing.assert_array_equal(to_numpy(q.dequantize()),
                                  reference(codes, zeros, scales, np.arange(256) // 64))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_from_gptq_v2_zeros_are_the_zero_points(lib):
    """A GPTQ v2 checkpoint stores the zero points themselves; loaded as such it dequantizes like the v1 form of
    the same weight, and loaded as v1 (the default) it would be one scale step off."""
    codes, zeros, scales = checkpoint(seed=5)          # zero points 1..15: both forms hold them
    qweight, sc = words(codes).T.copy(), np.ascontiguousarray(scales.T)
    qz2 = words(zeros.T)
    if lib == "torch":
        qweight, sc, qz2 = (torch.from_numpy(a) for a in (qweight, sc, qz2))
    q = QuantizedWeight.from_gptq(qweight, qz2, sc, group_size=64, checkpoint_format="gptq_v2")
    want = reference(codes, zeros, scales, np.arange(256) // 64)
    np.testing.assert_array_equal(to_numpy(q.dequantize()), want)
    assert type(q.tensors["qzeros"]) is type(qz2)
    as_v1 = QuantizedWeight.from_gptq(qweight, qz2, sc, group_size=64)
    assert not np.array_equal(to_numpy(as_v1.dequantize()), want)


def test_from_gptq_v2_refuses_a_zero_point_of_zero_and_unknown_formats():
    codes, zeros, scales = checkpoint(seed=6)
    zeros[0, 0] = 0
    with pytest.raises(InvalidInputError, match=r"holds 1 zero points of 0.*cannot hold"):
        QuantizedWeight.from_gptq(words(codes).T.copy(), words(zeros.T), scales.T.copy(), group_size=64,
                                  checkpoint_format="gptq_v2")
    with pytest.raises(InvalidInputError, match=r"checkpoint_format='v3': expected 'gptq'"):
        QuantizedWeight.from_gptq(words(codes).T.copy(), words(zeros.T), scales.T.copy(), group_size=64,
                                  checkpoint_format="v3")


def test_from_gptq_act_order_g_idx():
    codes, zeros, scales = checkpoint(seed=3)
    K, G = 256, 64
    g_idx = (np.arange(K) // G)[np.random.default_rng(4).permutation(K)].astype(np.int64)
    q = QuantizedWeight.from_gptq(words(codes).T.copy(), words((zeros - 1).T), scales.T.copy(),
                                  group_size=G, g_idx=g_idx)
    assert q.fmt.has_g_idx and q.tensors["g_idx"].dtype == np.int32
    np.testing.assert_array_equal(q.dequantize(), reference(codes, zeros, scales, g_idx))
    trivial = QuantizedWeight.from_gptq(words(codes).T.copy(), words((zeros - 1).T), scales.T.copy(),
                                        group_size=G, g_idx=torch.arange(K) // G)
    assert not trivial.fmt.has_g_idx and "g_idx" not in trivial.tensors


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_from_gguf_matches_gguf_py(qtype):
    T = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(5).standard_normal((8, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, T)
    expected = gguf.quants.dequantize(data, T)
    for d, t in [(data, qtype), (data.reshape(-1), T), (torch.from_numpy(data), qtype.lower())]:
        q = QuantizedWeight.from_gguf(d, t, (8, 96))
        assert q.fmt.group_size == 32 and q.fmt.symmetric and q.tensors["data"].shape == data.shape
        np.testing.assert_array_equal(to_numpy(q.dequantize()), expected)


def test_checkpoint_constructors_take_numpy_integers():
    """A group size or ggml type read from a checkpoint often arrives as a numpy integer (GGUF fields are
    numpy scalars): ``quantize`` took them, but ``from_awq`` / ``from_gptq`` refused ``np.int64(64)`` as "not an
    int" and ``from_gguf`` refused ``np.uint32(8)`` as an unsupported type."""
    codes, zeros, scales = checkpoint(seed=7)
    want = reference(codes, zeros, scales, np.arange(256) // 64)
    for G in (np.int64(64), np.int32(64)):
        awq = QuantizedWeight.from_awq(words(codes.T, AWQ_ORDER), words(zeros.T, AWQ_ORDER),
                                       np.ascontiguousarray(scales.T), group_size=G)
        gptq = QuantizedWeight.from_gptq(words(codes).T.copy(), words((zeros - 1).T), scales.T.copy(), group_size=G)
        for q in (awq, gptq):
            assert type(q.fmt.group_size) is int and q.fmt.group_size == 64
            np.testing.assert_array_equal(q.dequantize(), want)
    w = np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32)
    for qtype in ("Q4_0", "Q8_0"):
        T = getattr(gguf.GGMLQuantizationType, qtype)
        data = gguf.quants.quantize(w, T)
        for t in (np.uint32(int(T)), int(T)):
            np.testing.assert_array_equal(QuantizedWeight.from_gguf(data, t, (4, 64)).dequantize(),
                                          gguf.quants.dequantize(data, T))
    with pytest.raises(InvalidInputError, match=r"ggml_type=np.int64\(10\) is not supported"):  # Q2_K
        QuantizedWeight.from_gguf(data, np.int64(10), (4, 64))
    with pytest.raises(InvalidInputError, match=r"group_size=np.True_ must be an int >= 2"):
        QuantizedWeight.from_awq(words(codes.T, AWQ_ORDER), words(zeros.T, AWQ_ORDER),
                                 np.ascontiguousarray(scales.T), group_size=np.True_)


# -- devices -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_to_device_round_trip(device):
    q = quantize(np.random.default_rng(6).standard_normal((8, 64)), group_size=32)
    assert q.to("cpu") is q
    moved = q.to(device)
    if device == "cpu":
        assert moved is q
    else:
        assert moved is not q and str(moved.device) == device and moved.prepared == {}
        assert all(t.device.type == "cuda" for t in moved.tensors.values())
        back = moved.to("cpu")
        assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in back.tensors.values())
    np.testing.assert_array_equal(to_numpy(moved.dequantize()), q.dequantize())


# -- portakern.quantize: arguments ----------------------------------------------------------------

@pytest.mark.parametrize("symmetric", ["False", "no", None, 0, 1.0])
def test_quantize_refuses_a_symmetric_that_is_not_a_bool(symmetric):
    w = np.linspace(0.5, 2.0, 64).reshape(2, 32)  # all positive: symmetric and asymmetric differ
    with pytest.raises(InvalidTypeError, match=r"symmetric=.* must be True or False"):
        quantize(w, group_size=32, symmetric=symmetric)


def test_quantize_takes_a_numpy_bool_symmetric():
    w = np.linspace(0.5, 2.0, 64).reshape(2, 32)
    assert quantize(w, group_size=32, symmetric=np.bool_(True)).fmt.symmetric is True


def test_quantize_overflow_in_float32_does_not_suggest_float32():
    with pytest.raises(InvalidInputError, match="overflows scale_dtype=float32") as e:
        quantize(np.full((2, 32), 1e300), group_size=32, scale_dtype="float32")
    assert "pass scale_dtype='float32'" not in str(e.value)
    assert "rescale w" in str(e.value)


# -- QuantizedWeight dimensions ------------------------------------------------------------------

def _native(N=2, K=32):
    return {"qweight": np.zeros((N, K // 2), np.uint8), "scales": np.ones((N, 1), np.float16)}


@pytest.mark.parametrize("N, K, exc, fragment", [
    (True, 32, InvalidTypeError, "N=True must be an int"),
    (2, 32.0, InvalidTypeError, "K=32.0 must be an int"),
    ("2", 32, InvalidTypeError, "N='2' must be an int"),
    (0, 32, InvalidInputError, "N=0 must be >= 1"),
], ids=["N-bool", "K-float", "N-str", "N-zero"])
def test_quantized_weight_checks_its_dimensions(N, K, exc, fragment):
    tensors = _native(1 if N is True else 0 if N == 0 else 2, 32)
    with pytest.raises(exc, match=fragment):
        QuantizedWeight(QuantFormat(4, 32, True), N, K, tensors)


def test_quantized_weight_takes_numpy_integer_dimensions():
    w = QuantizedWeight(QuantFormat(4, 32, True), np.int64(2), np.int32(32), _native())
    assert w.shape == (2, 32) and type(w.N) is int and type(w.K) is int


@pytest.mark.parametrize("build", [
    lambda: QuantizedWeight.from_awq(np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32),
                                     np.zeros((0, 16), np.float16), group_size=32),
    lambda: QuantizedWeight.from_gptq(np.zeros((8, 0), np.int32), np.zeros((2, 0), np.int32),
                                      np.zeros((2, 0), np.float16), group_size=32),
], ids=["awq-K0", "gptq-N0"])
def test_checkpoint_constructors_refuse_an_empty_weight(build):
    with pytest.raises(InvalidInputError, match="must be a positive int"):
        build()


# -- messages say the way out ----------------------------------------------------------------------

@pytest.mark.parametrize("build, exc, fragment", [
    (lambda: QuantizedWeight.from_awq(np.zeros((64, 2), np.int32), np.zeros((2, 2), np.int32),
                                      np.ones((2, 16), np.int32), group_size=32),
     InvalidTypeError, r"scales has dtype int32: .*convert"),
    (lambda: QuantizedWeight.from_gptq(np.zeros((8, 16), np.int32), np.zeros((2, 2), np.int32),
                                       np.ones((2, 16), np.float16), group_size=32, g_idx=np.zeros(64)),
     InvalidTypeError, r"g_idx has dtype float64: .*astype"),
    (lambda: QuantizedWeight.from_awq(np.zeros(128, np.int32), np.zeros((2, 2), np.int32),
                                      np.ones((2, 16), np.float16), group_size=32),
     InvalidInputError, r"qweight has shape \(128,\): .*as the checkpoint stores it"),
    (lambda: quantize(np.zeros((2, 33)), group_size=-1), InvalidInputError, r"K=33 must be even .*pad"),
], ids=["scales-dtype", "g_idx-dtype", "qweight-1d", "odd-K"])
def test_checkpoint_errors_say_the_way_out(build, exc, fragment):
    with pytest.raises(exc, match=fragment):
        build()


# -- bfloat16 scales carried in float32 ------------------------------------------------------------

def _bf16_weight_tensors(scale):
    return {"qweight": np.full((1, 16), 0x99, np.uint8), "scales": np.array([[scale]], np.float32)}


def test_float32_carrier_of_bfloat16_scales_must_hold_bfloat16_values():
    """numpy has no bfloat16, so a bf16 format takes float32 scales holding bf16 values. 1.001 is not
    one: the reference would use 1.001 while a backend storing bf16 uses 1.0 -- refused instead."""
    fmt = QuantFormat(4, 32, True, scale_dtype=DType.bfloat16)
    with pytest.raises(InvalidInputError, match=r"tensors\['scales'\]\[0, 0\]=1.001 is not a bfloat16 value"):
        QuantizedWeight(fmt, 1, 32, _bf16_weight_tensors(1.001))
    with pytest.raises(InvalidInputError, match="is not a bfloat16 value"):
        P.dequantize(fmt, _bf16_weight_tensors(1.001), 1, 32)
    w = QuantizedWeight(fmt, 1, 32, _bf16_weight_tensors(1.0078125))  # bf16-exact: fine
    assert np.all(w.dequantize() == 1.0078125)


@pytest.mark.parametrize("build", [
    lambda: quantize(np.zeros((2, 1)), bits=8, group_size=-1),
    lambda: QuantizedWeight.from_awq(np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32),
                                     np.ones((1, 8), np.float16), group_size=-1),
], ids=["quantize", "from_awq"])
def test_group_size_minus_one_with_a_single_column_names_what_was_passed(build):
    """group_size=-1 is one group of K columns; with K=1 the message said 'group_size=1 must be an int
    >= 2', a value the caller never passed."""
    with pytest.raises(InvalidInputError, match=r"group_size=-1 .*K=1"):
        build()


# -- packed words of another integer type -----------------------------------------------------------

def test_int64_words_are_told_to_convert_not_to_view():
    """``.view(int32)`` of an int64 (K, N // 8) array doubles its columns: the old hint pointed there."""
    qw = np.zeros((64, 2), np.int64)
    with pytest.raises(InvalidTypeError, match=r"qweight has dtype int64 .*\.astype\(numpy\.int32\)") as e:
        QuantizedWeight.from_awq(qw, np.zeros((2, 2), np.int32), np.ones((2, 16), np.float16), group_size=32)
    assert ".view" not in str(e.value)


def test_uint32_words_are_told_to_view():
    qw = np.zeros((64, 2), np.uint32)
    with pytest.raises(InvalidTypeError, match=r"qweight has dtype uint32 .*\.view\(numpy\.int32\)"):
        QuantizedWeight.from_awq(qw, np.zeros((2, 2), np.int32), np.ones((2, 16), np.float16), group_size=32)


def test_int64_words_converted_as_told_dequantize_the_same():
    rng = np.random.default_rng(5)
    qw = rng.integers(-2**31, 2**31, (64, 2)).astype(np.int32)
    qz = rng.integers(-2**31, 2**31, (2, 2)).astype(np.int32)
    sc = np.ones((2, 16), np.float16)
    unsigned = qw.view(np.uint32).astype(np.int64)  # words read as unsigned, widened
    a = QuantizedWeight.from_awq(qw, qz, sc, group_size=32).dequantize()
    b = QuantizedWeight.from_awq(unsigned.astype(np.int32), qz, sc, group_size=32).dequantize()
    np.testing.assert_array_equal(a, b)


# -- bad input -----------------------------------------------------------------------------------

def awq_parts():
    codes, zeros, scales = checkpoint()
    return words(codes.T, AWQ_ORDER), words(zeros.T, AWQ_ORDER), np.ascontiguousarray(scales.T)


W = np.zeros((8, 64), np.float32)
BAD = {
    "quantize bits": (lambda: quantize(W, bits=3), InvalidInputError, "bits=3 is not supported"),
    "quantize group": (lambda: quantize(W, group_size=48), InvalidInputError,
                       "group_size=48 does not divide K=64: pick a divisor of K (such as 64, 32"),
    "quantize group 0": (lambda: quantize(W, group_size=0), InvalidInputError, "group_size=0 must be an int >= 2"),
    "quantize 1-D": (lambda: quantize(W[0]), InvalidInputError, "w has shape (64,): expected a 2-D weight"),
    "quantize int": (lambda: quantize(W.astype(np.int8)), InvalidTypeError, "w has dtype int8"),
    "quantize list": (lambda: quantize([[1.0, 2.0]]), InvalidTypeError, "w is a builtins.list"),
    "quantize nan": (lambda: quantize(np.full((2, 64), np.nan), group_size=32), InvalidInputError, "must be finite"),
    "awq float qweight": (lambda: QuantizedWeight.from_awq(awq_parts()[0].astype(np.float32), *awq_parts()[1:],
                                                           group_size=64),
                          InvalidTypeError, "qweight has dtype float32 but packing awq"),
    "awq group size": (lambda: QuantizedWeight.from_awq(*awq_parts(), group_size=128), InvalidInputError,
                       "qzeros has shape (4, 4) but packing awq (bits=4, group_size=128, N=32, K=256) "
                       "needs (K // group_size, N // 8) = (2, 4); that shape fits group_size=64"),
    "awq int scales": (lambda: QuantizedWeight.from_awq(*awq_parts()[:2], awq_parts()[2].astype(np.int32),
                                                        group_size=64), InvalidTypeError, "scales has dtype int32"),
    "gptq g_idx range": (lambda: QuantizedWeight.from_gptq(
        np.zeros((8, 8), np.int32), np.zeros((2, 1), np.int32), np.ones((2, 8), np.float16), group_size=32,
        g_idx=np.full(64, 2)), InvalidInputError, "g_idx[0]=2 is out of range"),
    "gptq g_idx shape": (lambda: QuantizedWeight.from_gptq(
        np.zeros((8, 8), np.int32), np.zeros((2, 1), np.int32), np.ones((2, 8), np.float16), group_size=32,
        g_idx=np.zeros(63, np.int32)), InvalidInputError, "g_idx has shape (63,): it must be (K,) = (64,)"),
    "gptq g_idx float": (lambda: QuantizedWeight.from_gptq(
        np.zeros((8, 8), np.int32), np.zeros((2, 1), np.int32), np.ones((2, 8), np.float16), group_size=32,
        g_idx=np.zeros(64)), InvalidTypeError, "g_idx has dtype float64"),
    "gguf type": (lambda: QuantizedWeight.from_gguf(np.zeros((1, 18), np.uint8), "Q2_K", (1, 32)),
                  InvalidInputError, "ggml_type='Q2_K' is not supported: from_gguf reads Q4_0, Q8_0, Q4_K"),
    "gguf bytes": (lambda: QuantizedWeight.from_gguf(np.zeros((2, 18), np.uint8), "Q8_0", (2, 32)),
                   InvalidInputError, "needs N * K // 32 * 34 = 68 bytes"),
    "gguf dtype": (lambda: QuantizedWeight.from_gguf(np.zeros((1, 18), np.int8), "Q4_0", (1, 32)),
                   InvalidTypeError, "data has dtype int8: GGUF blocks are raw bytes"),
    "mixed libraries": (lambda: QuantizedWeight(QuantFormat(4, 32, True), 2, 64, {
        "qweight": np.zeros((2, 32), np.uint8), "scales": torch.ones(2, 2, dtype=torch.float16)}),
        InvalidTypeError, "a QuantizedWeight keeps every tensor in one library on one device"),
    "missing zeros": (lambda: QuantizedWeight(QuantFormat(4, 32, False), 2, 64, {
        "qweight": np.zeros((2, 32), np.uint8), "scales": np.ones((2, 2), np.float16)}),
        InvalidInputError, "missing ['zeros']"),
    "bad device": (lambda: quantize(W, group_size=32).to("tpu:0"), InvalidInputError, "device='tpu:0' is not a device"),
    "fmt not a QuantFormat": (lambda: QuantizedWeight("native", 2, 64, {}), InvalidTypeError,
                              "fmt is a str: expected a portakern.ir.QuantFormat; build one with QuantFormat("),
    "gguf shape not 2 ints": (lambda: QuantizedWeight.from_gguf(np.zeros(36, np.uint8), "Q4_0", (2,)),
                              InvalidInputError, "shape=(2,) must be two positive ints (N, K)"),
    "gguf shape zero": (lambda: QuantizedWeight.from_gguf(np.zeros(36, np.uint8), "Q4_0", (0, 64)),
                        InvalidInputError, "shape=(0, 64) must be two positive ints (N, K)"),
    "awq qweight 1-D": (lambda: QuantizedWeight.from_awq(np.zeros(8, np.int32), np.zeros((2, 1), np.int32),
                                                         np.ones((2, 8), np.float16), group_size=32),
                        InvalidInputError, "qweight has shape (8,): it must be 2-D (K, N // 8)"),
    "awq group_size 1": (lambda: QuantizedWeight.from_awq(np.zeros((64, 1), np.int32), np.zeros((2, 1), np.int32),
                                                          np.ones((2, 8), np.float16), group_size=1),
                         InvalidInputError, "group_size=1 must be an int >= 2, or -1 for one group per row; use the "
                                            "value from the checkpoint's quantization config"),
    "gptq group_size bool": (lambda: QuantizedWeight.from_gptq(np.zeros((8, 8), np.int32), np.zeros((2, 1), np.int32),
                                                               np.ones((2, 8), np.float16), group_size=True),
                             InvalidInputError, "group_size=True must be an int >= 2"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    call, exc, fragment = BAD[case]
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), str(info.value)
    assert isinstance(info.value, (ValueError, TypeError))


def test_gguf_shape_in_file_order_is_caught():
    # a Q4_0 weight (N=2, K=64) given with the file's innermost-first shape (64, 2): K=2 is no block
    with pytest.raises(InvalidInputError, match="K=2 must be a multiple of 32 .* reverse it"):
        QuantizedWeight.from_gguf(np.zeros((2, 36), np.uint8), "Q4_0", (64, 2))


def test_cupy_arrays_stay_cupy():
    cupy = pytest.importorskip("cupy")  # only where CuPy and a GPU exist
    w = np.random.default_rng(7).standard_normal((8, 64)).astype(np.float32)
    q = quantize(cupy.asarray(w), group_size=32)
    assert all(isinstance(t, cupy.ndarray) for t in q.tensors.values()) and q.device.type == "cuda"
    deq = q.dequantize()
    assert isinstance(deq, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(deq), quantize(w, group_size=32).dequantize())
    host = q.to("cpu")
    assert all(isinstance(t, np.ndarray) for t in host.tensors.values())


def test_to_cuda_takes_numpy_views_with_negative_strides(monkeypatch):
    """``torch.from_numpy`` refuses negative strides: ``.to("cuda")`` of a weight built from reversed
    numpy views raised torch's bare ValueError. The host side of the move is what is checked here, so
    ``Tensor.to`` is made to stay on the CPU (no GPU needed)."""
    targets = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: (targets.append(a), self)[1])
    w = quantize(np.linspace(-1, 1, 8 * 64).reshape(8, 64), group_size=32)
    flipped = QuantizedWeight(w.fmt, 8, 64, {k: v[::-1].copy()[::-1] for k, v in w.tensors.items()})
    assert all(v.strides[0] < 0 for v in flipped.tensors.values())
    moved = flipped.to("cuda:0")
    assert ("cuda:0",) in targets and all(isinstance(t, torch.Tensor) for t in moved.tensors.values())
    np.testing.assert_array_equal(moved.dequantize().numpy(), w.dequantize())
