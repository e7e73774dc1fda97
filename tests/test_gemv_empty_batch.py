"""``portakern.quant_gemv`` with an x of zero rows: the (0, N) result the torch op also gives, after the same checks
a batch of rows gets (before, the API raised "M=0 must be a positive int" while the torch op returned (0, N))."""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern.errors import InvalidInputError, InvalidTypeError, UnsupportedError
from portakern.quantize import quantize


@pytest.fixture
def weight():
    w = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    return quantize(w, bits=4, group_size=32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_empty_batch_gives_empty_rows(weight, dtype):
    out = portakern.quant_gemv(np.zeros((0, 64), dtype), weight)
    assert isinstance(out, np.ndarray) and out.shape == (0, 8) and out.dtype == dtype


def test_empty_batch_with_the_silu_mul_prologue_has_n_columns(weight):
    out = portakern.quant_gemv(np.zeros((0, 128), np.float32), weight, prologue="silu_mul")
    assert out.shape == (0, 8)


def test_torch_empty_batch_matches_the_torch_op(weight):
    torch = pytest.importorskip("torch")
    x = torch.zeros((0, 64), dtype=torch.bfloat16)
    out = portakern.quant_gemv(x, weight)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 8) and out.dtype == torch.bfloat16


def test_empty_batch_still_checks_k(weight):
    with pytest.raises(InvalidInputError, match=r"x has K=63 columns but w is \(8, 64\)"):
        portakern.quant_gemv(np.zeros((0, 63), np.float32), weight)


def test_empty_batch_still_checks_dtype_and_weight(weight):
    with pytest.raises(InvalidTypeError, match="x has dtype int32"):
        portakern.quant_gemv(np.zeros((0, 64), np.int32), weight)
    with pytest.raises(InvalidTypeError, match="expected a portakern.QuantizedWeight"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), np.zeros((8, 64), np.float32))


def test_empty_batch_still_checks_the_backend_name(weight):
    with pytest.raises((InvalidInputError, UnsupportedError), match="no-such-backend"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), weight, backend="no-such-backend")
    with pytest.raises(InvalidTypeError, match="must be a backend name"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), weight, backend=3)


def test_a_batch_of_rows_still_computes(weight):
    x = np.linspace(-2, 2, 2 * 64, dtype=np.float32).reshape(2, 64)
    want = x.astype(np.float64) @ np.asarray(weight.dequantize(), np.float64).T
    np.testing.assert_allclose(portakern.quant_gemv(x, weight), want, rtol=1e-5, atol=1e-5)


def test_empty_batch_still_checks_a_backend_forced_by_the_environment(weight, monkeypatch):
    # PORTAKERN_BACKEND naming no backend fails a batch of rows; an empty batch used to return (0, N) regardless
    monkeypatch.setenv("PORTAKERN_BACKEND", "no-such-backend")
    for rows in (1, 0):
        with pytest.raises(InvalidInputError, match="backend='no-such-backend' is not registered"):
            portakern.quant_gemv(np.zeros((rows, 64), np.float32), weight)


@pytest.mark.parametrize("rows", [1, 0])
def test_empty_batch_is_refused_by_a_forced_backend_that_cannot_run_it(weight, register_plugin, rows):
    # an empty batch used to return (0, N) from a forced backend whose supports() refuses the problem
    from portakern.backend import Backend, no
    from plugin_helpers import provides

    class Picky(Backend):
        name, array_kind, device_types = "picky", "numpy", ("cpu",)

        def supports(self, op, device):
            return no(f"group_size={op.fmt.group_size} must be 128; requantize")

    register_plugin(provides(Picky()), name="picky")
    x = np.zeros((rows, 64), np.float32)
    with pytest.raises(UnsupportedError, match=r"not supported by picky on cpu.*group_size=32 must be 128.*"
                                               r"pass backend='cpu'") as info:
        portakern.quant_gemv(x, weight, backend="picky")
    assert ("checked as its problem with one row" in str(info.value)) == (rows == 0)
    assert portakern.quant_gemv(x, weight, backend="cpu").shape == (rows, 8)


def test_empty_batch_is_checked_once_per_signature(weight, monkeypatch, fresh_registry):
    from portakern import api, dispatch

    calls = []
    real = api.quant_gemv_op
    monkeypatch.setattr(api, "quant_gemv_op", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = np.zeros((0, 64), np.float32)
    a, b = portakern.quant_gemv(x, weight), portakern.quant_gemv(x.copy(), weight)
    assert len(calls) == 1 and a.shape == b.shape == (0, 8) and a.dtype == np.float32 and a is not b
    portakern.quant_gemv(np.zeros((0, 64), np.float16), weight)   # another signature
    assert len(calls) == 2
    dispatch.clear_cache()
    portakern.quant_gemv(x, weight)
    assert len(calls) == 3
