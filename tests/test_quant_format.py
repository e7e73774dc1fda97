"""``QuantFormat`` and the IR's packer: fields and dimensions of the wrong type are refused with a portakern error,
``from_json`` names the key at fault, and ``pack`` refuses values it would otherwise truncate and rounds bfloat16
scales to nearest from float64."""

from __future__ import annotations

import numpy as np
import pytest

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import packing as P


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


# -- the bfloat16 scales' carrier ------------------------------------------------------------------

def test_bfloat16_scales_hint_names_no_numpy_bfloat16():
    fmt = QuantFormat(4, 32, True, scale_dtype=DType.bfloat16)
    with pytest.raises(InvalidTypeError, match=r"float32 holding bfloat16 values") as e:
        P.validate_tensors(fmt, {"qweight": np.zeros((2, 16), np.uint8), "scales": np.zeros((2, 1))}, 2, 32)
    assert "numpy.bfloat16" not in str(e.value)
