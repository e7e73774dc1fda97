"""Review of the quantized-weight layer: arguments that were accepted with the wrong meaning, or
refused with a builtin error instead of portakern's, and values rounded against the contract."""

from __future__ import annotations

import numpy as np
import pytest

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import packing as P
from portakern.quantize import quantize
from portakern.quantized import QuantizedWeight


# -- QuantFormat fields of the wrong type ----------------------------------------------------------

@pytest.mark.parametrize("fmt, fragment", [
    (QuantFormat(4, 32, "no"), "symmetric='no' must be True or False"),
    (QuantFormat(4, 32, None), "symmetric=None must be True or False"),
    (QuantFormat(4, 32, False, Packing.GPTQ, has_g_idx="no"), "has_g_idx='no' must be True or False"),
    (QuantFormat(4, 32, True, scale_dtype="float16"), "scale_dtype='float16' must be a DType"),
    (QuantFormat(4.0, 32, True), "bits=4.0 must be an int"),
], ids=["symmetric-str", "symmetric-none", "has_g_idx-str", "scale_dtype-str", "bits-float"])
def test_quant_format_refuses_fields_of_the_wrong_type(fmt, fragment):
    with pytest.raises(InvalidInputError, match="QuantFormat: " + fragment):
        fmt.verify(K=64, N=8)


@pytest.mark.parametrize("K, N, fragment", [(-64, 8, "K=-64 must be a positive int"),
                                            (0, 8, "K=0 must be a positive int"),
                                            (64.0, 8, "K=64.0 must be a positive int"),
                                            (64, -8, "N=-8 must be a positive int")])
def test_quant_format_verify_refuses_bad_dimensions(K, N, fragment):
    with pytest.raises(InvalidInputError, match="QuantFormat: " + fragment):
        QuantFormat(4, 32, False, Packing.AWQ).verify(K=K, N=N)


def test_quant_format_verify_takes_numpy_integer_dimensions():
    QuantFormat(4, 32, False, Packing.AWQ).verify(K=np.int64(64), N=np.int32(8))  # no error


# -- portakern.quantize --------------------------------------------------------------------------

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


# -- pack ------------------------------------------------------------------------------------------

def test_pack_refuses_a_float_g_idx_instead_of_truncating_it():
    fmt = QuantFormat(4, 16, False, Packing.GPTQ, has_g_idx=True)
    g_idx = np.repeat([0.9, 1.9], 16)  # int32 truncation would silently read groups 0, 1
    with pytest.raises(InvalidTypeError, match=r"g_idx has dtype float64: .*integer"):
        P.pack(fmt, np.zeros((8, 32), int), np.ones((8, 2)), np.ones((8, 2), int), 8, 32, g_idx=g_idx)


def test_pack_refuses_scales_that_are_not_numbers():
    with pytest.raises(InvalidTypeError, match="scales"):
        P.pack(QuantFormat(4, 32, True), np.zeros((2, 32), int), "a", None, 2, 32)


def test_pack_rounds_bfloat16_scales_to_nearest_from_float64():
    """1 + 2^-8 + 2^-30 is just above the bf16 midpoint 1 + 2^-8: nearest is 1 + 2^-7. Rounding to
    float32 first lands exactly on the midpoint, and ties-to-even then gives 1.0."""
    x = 1 + 2.0**-8 + 2.0**-30
    t = P.pack(QuantFormat(4, 32, True, scale_dtype=DType.bfloat16), np.zeros((1, 32), int), [[x]], None, 1, 32)
    assert float(t["scales"][0, 0]) == 1 + 2.0**-7
    # ties still go to even, and the bf16 subnormals and overflow behave
    vals = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 3 * 2.0**-134, 3.0**200, -(1 + 2.0**-8 + 2.0**-30), 0.0, -0.0])
    t = P.pack(QuantFormat(4, 32, True, scale_dtype=DType.bfloat16), np.zeros((7, 32), int), vals[:, None],
               None, 7, 32)
    got = t["scales"][:, 0].astype(np.float64)
    assert got[:3].tolist() == [1.0, 1 + 2.0**-6, 2.0**-132]  # the last: a tie among bf16 subnormals
    assert np.isinf(got[3]) and got[4] == -(1 + 2.0**-7)
    assert got[5] == 0 and np.signbit(got[6])


# -- QuantFormat.from_json -------------------------------------------------------------------------

@pytest.mark.parametrize("d, fragment", [
    ({"bits": 4, "group_size": 32, "symmetric": True, "packing": "bogus", "scale_dtype": "float16"},
     "packing='bogus'"),
    ({"bits": 4, "group_size": 32, "symmetric": True, "packing": "native", "scale_dtype": "float99"},
     "scale_dtype='float99'"),
    ({"bits": 4}, "missing 'group_size'"),
    ([1], "must be a dict"),
], ids=["packing", "scale_dtype", "missing", "not-a-dict"])
def test_quant_format_from_json_errors_name_the_key(d, fragment):
    with pytest.raises(InvalidInputError, match="QuantFormat.from_json: .*" + fragment):
        QuantFormat.from_json(d)


def test_quant_format_json_round_trip():
    fmt = QuantFormat(4, 64, False, Packing.GPTQ, DType.bfloat16, has_g_idx=True)
    assert QuantFormat.from_json(fmt.to_json()) == fmt


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


# -- device moves ----------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


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


def test_bfloat16_scales_hint_names_no_numpy_bfloat16():
    fmt = QuantFormat(4, 32, True, scale_dtype=DType.bfloat16)
    with pytest.raises(InvalidTypeError, match=r"float32 holding bfloat16 values") as e:
        P.validate_tensors(fmt, {"qweight": np.zeros((2, 16), np.uint8), "scales": np.zeros((2, 1))}, 2, 32)
    assert "numpy.bfloat16" not in str(e.value)
