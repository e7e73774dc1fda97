"""The quant_gemv ``silu_mul`` prologue: IR, argument checks, dispatch's capability check, the cpu reference
against an independent float64 product, and the triton backend's lowering (the interpreter and GPU value tests
are the ``*-silu-*`` cases of ``tests/gemv_cases.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern import Backend
from portakern.backend import YES
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir import DType, Packing, QuantFormat, QuantGemv
from portakern.ir.packing import dequantize
from portakern.quantize import quantize
from gemv_cases import reference_input  # noqa: E402
from plugin_helpers import provides  # noqa: E402
from triton_helpers import needs_compiler  # noqa: E402


def _silu_mul(x: np.ndarray, K: int) -> np.ndarray:
    """float64 ``silu(gate) * up`` of ``x = [gate | up]`` (the GEMV tests' own formula, not a backend's)."""
    return reference_input(x.astype(np.float64), "silu_mul", K)


def _op(**changes) -> QuantGemv:
    base = dict(M=1, N=64, K=256, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    return QuantGemv(**{**base, **changes})


# -- the IR -------------------------------------------------------------------------------------------

def test_ir_prologue_widens_x_round_trips_and_leaves_plain_hashes_alone():
    op = _op(prologue="silu_mul").verify()
    assert op.shapes() == {"x": (1, 512), "out": (1, 64)} and op.x_columns == 512
    assert QuantGemv.from_json(op.to_json()) == op
    plain = _op()
    assert "prologue" not in plain.to_json() and QuantGemv.from_json(plain.to_json()) == plain
    assert op.content_hash() != plain.content_hash()
    # the hash of a plain GEMV is what it was before prologues existed (cache keys and goldens stay valid)
    assert plain.content_hash() == QuantGemv.from_json({k: v for k, v in plain.to_json().items()}).content_hash()
    with pytest.raises(Exception, match=r"prologue='gelu' must be None or one of 'silu_mul'"):
        _op(prologue="gelu").verify()


# -- arguments ----------------------------------------------------------------------------------------

@pytest.fixture
def w():
    return quantize(np.random.default_rng(0).standard_normal((48, 256)), bits=4, group_size=64)


@pytest.mark.parametrize("cols, prologue, match", [
    (257, "silu_mul", r"x has 257 columns but w is \(48, 256\) and prologue='silu_mul' reads gate and up from x: "
                      r"x must be \(M, 2 \* 256\) = \(M, 512\), gate first"),
    (256, "silu_mul", r"x has 256 columns .* x must be \(M, 2 \* 256\)"),
    (512, None, r"x has K=512 columns but w is \(48, 256\): x must be \(M, 256\)"),
    (512, "gelu", r"prologue='gelu' is not a quant_gemv prologue: use None or one of 'silu_mul'"),
])
def test_bad_arguments_name_the_argument_the_rule_and_the_way_out(w, cols, prologue, match):
    x = np.zeros((2, cols), np.float32)
    with pytest.raises(InvalidInputError, match=match):
        portakern.quant_gemv(x, w, prologue=prologue)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float16, 2e-3)])
def test_cpu_reference_matches_float64(w, dtype, tol):
    """The cpu backend against the float64 product of ``silu(gate) * up`` and the dequantized weight, including
    gates far out in both tails (where a naive ``exp(-g)`` overflows)."""
    x = (np.random.default_rng(1).standard_normal((3, 512)) * 3).astype(dtype)
    x[0, 0], x[1, 1] = -60.0, 60.0
    y = portakern.quant_gemv(x, w, prologue="silu_mul", backend="cpu")
    ref = _silu_mul(x, 256) @ dequantize(w.fmt, w.tensors, 48, 256).T
    assert y.dtype == dtype and y.shape == (3, 48) and np.isfinite(y).all()
    assert np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max() < tol


# -- dispatch -----------------------------------------------------------------------------------------

class Plain(Backend):
    """A numpy backend from before prologues: says yes to everything, lists none."""

    name = "plain"
    array_kind = "numpy"
    device_types = ("cpu",)
    priority = 100

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        def kernel(x, weight, out):
            out[...] = 7.0
        return kernel


def test_dispatch_never_offers_a_prologue_to_a_backend_that_does_not_list_it(register_plugin, w):
    register_plugin(provides(Plain()), name="plain")
    x = np.random.default_rng(2).standard_normal((1, 512)).astype(np.float32)
    d = portakern.explain(portakern.quant_gemv, x, w, prologue="silu_mul")
    plain = next(c for c in d.candidates if c.name == "plain")
    assert not plain.support.ok and "does not implement the quant_gemv prologue 'silu_mul'" in plain.support.reason
    assert d.chosen == "cpu"
    y = portakern.quant_gemv(x, w, prologue="silu_mul")
    assert np.allclose(y, _silu_mul(x, 256) @ dequantize(w.fmt, w.tensors, 48, 256).T, rtol=1e-5, atol=1e-5)
    # without a prologue the high-priority plain backend runs as before
    assert (portakern.quant_gemv(x[:, :256], w) == 7.0).all()
    with pytest.raises(UnsupportedError, match=r"not supported by plain .*prologue 'silu_mul'.*pass backend='cpu'"):
        portakern.quant_gemv(x, w, prologue="silu_mul", backend="plain")


# -- the triton backend's lowering --------------------------------------------------------------------

@needs_compiler
@pytest.mark.parametrize("M, target", [(1, "sm_90a"), (16, "sm_90a"), (4, "sm_80")])
def test_triton_lowers_the_prologue_on_the_cuda_core_kernel(M, target):
    """Every M takes the CUDA-core kernel (kind "fma") with the prologue, whose PTX reads x twice as wide and
    evaluates the sigmoid (``ex2``); the same op without it keeps the table's kernel and has no ``ex2``."""
    pytest.importorskip("triton")
    from portakern.backends.triton import quant_gemv as Q

    op = QuantGemv(M=M, N=4096, K=14336, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128,
                                                                                  symmetric=False))
    glu = Q.compile_for_target(op.replace(prologue="silu_mul"), target)
    assert glu["config"]["kind"] == "fma"
    ptx = next(iter(glu["kernels"].values()))["ptx"]
    assert "ex2.approx" in ptx
    plain = Q.compile_for_target(op, target)
    if plain["config"]["kind"] == "fma":
        assert "ex2.approx" not in next(iter(plain["kernels"].values()))["ptx"]


@needs_compiler
def test_triton_refuses_a_forced_kernel_without_the_prologue():
    pytest.importorskip("triton")
    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton import quant_gemv as Q

    op = QuantGemv(M=16, N=256, K=512, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128,
                                                                                symmetric=False), prologue="silu_mul")
    cfg = T.GemvConfig("mma", block_n=64, block_kw=16, num_warps=4)
    with pytest.raises(UnsupportedError, match=r"GemvConfig\(kind='mma'\) has no x prologue; .*use kind='fma'"):
        Q.compile_for_target(op, "sm_90a", cfg)


@needs_compiler
def test_triton_forms_the_input_once_per_program_at_batch_1(monkeypatch):
    """GLU mode 2 (``quant_gemv.glu_mode``: one scratch row per program, formed after the wait) at M = 1 without
    act-order; mode 1 (per thread) for act-order, several rows, or a scratch over the cap; 0 without a prologue."""
    pytest.importorskip("triton")
    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv import aot as QA, launcher as QL

    def mode(M=1, act=False, N=4096, K=14336, prologue="silu_mul"):
        fmt = QuantFormat(bits=4, group_size=128, symmetric=False, packing=Packing("gptq" if act else "native"),
                          has_g_idx=act)
        op = QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=fmt, prologue=prologue)
        lay = QA.LayoutStub(op)
        cfg = T.choose(lay, M, N, "sm_90", 132, cuda_core=True)
        return QL.glu_mode(op, lay, cfg), QL.glu_scratch_values(op, lay, cfg)

    m, values = mode()
    assert m == 2 and values == 512 * 1792               # 64 column tiles x 8 slices, 224 words of 8 codes each
    assert mode(act=True)[0] == 1 and mode(M=16)[0] == 1 and mode(prologue=None)[0] == 0
    monkeypatch.setattr(QL, "GLU_SCRATCH_MAX_BYTES", values * 4 - 1)
    assert mode()[0] == 1                                # a scratch over GLU_SCRATCH_MAX_BYTES
