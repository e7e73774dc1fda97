"""The cpu reference quantized-GEMV kernel: its operand checks, called directly (below the API)."""

from __future__ import annotations

import numpy as np
import pytest

from portakern.backends.cpu.quant_gemv import quant_gemv_kernel
from portakern.errors import InvalidInputError
from portakern.ir import DType, QuantGemv
from portakern.quantize import quantize


@pytest.fixture
def weight():
    w = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    return quantize(w, bits=4, group_size=32)


def _op(weight, M=2, N=8, K=64, fmt=None):
    return QuantGemv(M=M, N=N, K=K, dtype=DType.float32, fmt=fmt or weight.fmt).verify()


def test_reference_matches_dequantize_matmul(weight):
    x = np.linspace(-2, 2, 2 * 64, dtype=np.float32).reshape(2, 64)
    out = np.full((2, 8), np.nan, np.float32)
    quant_gemv_kernel(_op(weight))(x, weight, out)
    want = x.astype(np.float64) @ np.asarray(weight.dequantize(), np.float64).T
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["x", "out"])
def test_operand_shape_is_named(weight, name):
    shapes = {"x": (2, 64), "out": (2, 8)}
    shapes[name] = (3, shapes[name][1])
    x, out = np.zeros(shapes["x"], np.float32), np.zeros(shapes["out"], np.float32)
    with pytest.raises(InvalidInputError, match=rf"{name} has shape \(3, \d+\), expected \(2, \d+\) for "
                                                r"QuantGemv\(M=2, N=8, K=64\)"):
        quant_gemv_kernel(_op(weight))(x, weight, out)


def test_weight_shape_differs_from_the_op(weight):
    op = _op(weight, N=16)
    with pytest.raises(InvalidInputError, match=r"weight has shape \(8, 64\), expected \(N, K\) = \(16, 64\): "
                                                r"build the op with N=weight.N, K=weight.K"):
        quant_gemv_kernel(op)(np.zeros((2, 64), np.float32), weight, np.zeros((2, 16), np.float32))


def test_weight_format_differs_from_the_op(weight):
    other = quantize(np.ones((8, 64), np.float32), bits=8, group_size=32).fmt
    with pytest.raises(InvalidInputError, match=r"differs from the op's format .*: build the op with fmt=weight.fmt"):
        quant_gemv_kernel(_op(weight, fmt=other))(np.zeros((2, 64), np.float32), weight,
                                                  np.zeros((2, 8), np.float32))
