"""The triton backend's host code hands its kernels only what they read correctly.

* A compiled quant_gemv kernel keeps one launcher per weight layout (``PreparedGemvWeight.key``); a second
  weight whose group size, bits or shape differ from the first must not run through the first weight's
  launcher (its constexprs carry the group size), and a weight on another device than the kernel's is refused.
* Attention's 1-D index arrays (``seqlens_k``, ``cu_seqlens_q`` / ``_k``) are read by the kernels at unit
  stride: ``unit_stride_aux`` copies strided views (that a strided view gives its values' results is checked on
  every backend by the contract suite, tests/contract).
* Views of x or of the output whose rows lie 2^31 elements apart or more are copied or refused.

Kernel launches run under Triton's interpreter: those tests are marked ``interpreter`` (``triton_helpers``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gemv_cases import weight  # noqa: E402  (tests/ is on sys.path)
from triton_helpers import _cache_dir  # noqa: E402,F401  (the module's expression cache)

from portakern.devices import CPU  # noqa: E402
from portakern.errors import InvalidInputError, InvalidTypeError  # noqa: E402
from portakern.ir import DType  # noqa: E402
from portakern.ir.ops import QuantGemv  # noqa: E402


# -- quant_gemv: one launcher per weight layout ------------------------------------------------------

M, N, K = 1, 40, 256


def _case(group: int, n: int = N, seed: int = 0):
    """A native asymmetric int4 weight ``(n, K)`` with ``group``-column groups, prepared on the CPU, and its
    float64 dequantisation."""
    from portakern.gemv_weight import prepare_gemv_weight

    w = weight((f"g{group}", "native", 4, group, False, M, n, K, "float32", {}), seed=seed)
    return w, prepare_gemv_weight(w, CPU)


def _dequant(w) -> np.ndarray:
    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    codes, scales, zeros, group = unpack(w.fmt, {k: np.asarray(to_numpy(v)) for k, v in w.tensors.items()}, w.N, w.K)
    return (codes - zeros[:, group]) * scales[:, group]


def _kernel(fmt):
    from portakern.backends.triton import quant_gemv as Q

    return Q.compile(QuantGemv(M=M, N=N, K=K, dtype=DType.float32, fmt=fmt), CPU)


@pytest.mark.interpreter
def test_gemv_weight_of_another_group_size_is_refused_not_run_with_the_first_weights_launcher():
    """The group-64 weight has the group-128 weight's padded layout (same key before the fix), so it ran through
    the launcher built for group 128 and returned wrong values without an error."""
    w128, p128 = _case(128)
    w64, p64 = _case(64, seed=1)
    kern = _kernel(w128.fmt)
    x = torch.randn(M, K)
    out = torch.empty(M, N)
    kern(x, p128, out)
    np.testing.assert_allclose(out.numpy(), x.double().numpy() @ _dequant(w128).T, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidInputError, match=r"group_size = 64 but this quant_gemv op was compiled for 128; "
                                                r"prepare the weight of this op"):
        kern(x, p64, torch.empty(M, N))


@pytest.mark.interpreter
def test_gemv_weight_of_another_shape_is_refused_after_a_first_call():
    """N = 38 pads to the N = 40 weight's row stride: before the fix only the first call compared shapes."""
    w40, p40 = _case(128)
    _, p38 = _case(128, n=38, seed=2)
    kern = _kernel(w40.fmt)
    kern(torch.randn(M, K), p40, torch.empty(M, N))
    with pytest.raises(InvalidInputError, match=r"\(N, K\) = \(38, 256\) but this quant_gemv op was compiled "
                                                r"for \(40, 256\)"):
        kern(torch.randn(M, K), p38, torch.empty(M, N))


@pytest.mark.interpreter
def test_gemv_weight_on_another_device_is_refused():
    """A weight whose tensors live elsewhere than the kernel's device (here: meta tensors for a CPU kernel; on a
    machine with GPUs, cuda:1 for a cuda:0 kernel) is an InvalidTypeError naming the tensor and the way out."""
    w, p = _case(128)
    kern = _kernel(w.fmt)
    kern(torch.randn(M, K), p, torch.empty(M, N))
    elsewhere = dataclasses.replace(p, **{n: t.to("meta") for n, t in p.tensors().items()})
    with pytest.raises(InvalidTypeError, match=r"prepared weight's qweight is on meta but this quant_gemv kernel "
                                               r"was compiled for cpu; prepare the weight on cpu"):
        kern(torch.randn(M, K), elsewhere, torch.empty(M, N))


# -- attention: 1-D index arrays at unit stride --------------------------------------------------------

def _column(values) -> "torch.Tensor":
    """``values`` as int32 column 0 of a ``(n, 2)`` table whose column 1 holds 99: a view of stride 2, which a
    kernel reading at unit stride would see as ``values[0], 99, values[1], ...``."""
    table = torch.tensor([[v, 99] for v in values], dtype=torch.int32)
    col = table[:, 0]
    assert col.stride() == (2,) and col.tolist() == list(values)
    return col


def test_unit_stride_aux_copies_only_strided_index_arrays():
    """Contiguous arrays, None and the block table (read with its strides) pass as the same objects."""
    from portakern.backends.triton.attention.checks import unit_stride_aux

    lens, bt = torch.arange(3, dtype=torch.int32), torch.zeros((4, 3), dtype=torch.int32).t()
    aux = {"block_table": bt, "seqlens_k": lens, "cu_seqlens_q": None}
    assert unit_stride_aux(aux) is aux
    strided = dict(aux, seqlens_k=_column([5, 6, 7]))
    fixed = unit_stride_aux(strided)
    assert fixed["seqlens_k"].stride() == (1,) and fixed["seqlens_k"].tolist() == [5, 6, 7]
    assert fixed["block_table"] is bt and strided["seqlens_k"].stride() == (2,)   # the caller's dict untouched


# -- quant_gemv: the kernels' 32-bit offsets ---------------------------------------------------------------

def _rows_apart(rows: int, cols: int, dtype=torch.float16) -> "torch.Tensor":
    """A ``(rows, cols)`` view whose last row starts 2^31 + 128 elements after its first (the storage is
    allocated, untouched but for the view's rows)."""
    stride = ((1 << 31) + 128) // (rows - 1)
    big = torch.empty(stride * (rows - 1) + cols, dtype=dtype)
    return big.as_strided((rows, cols), (stride, 1))


def test_gemv_supports_refuses_x_or_output_past_32_bit_offsets():
    """An output of 2^31 elements or more (a vocabulary projection over a long prefill) is refused, naming how
    many rows fit; before, it was accepted and the kernels' row offsets wrapped."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.devices import Device
    from portakern.ir import QuantFormat

    gpu = Device("cuda", 0, "sm_90", "test GPU", (9, 0), 32)
    fmt = QuantFormat(bits=4, group_size=128, symmetric=False)
    assert Q.supports(QuantGemv(M=16384, N=131072, K=4096, dtype=DType.float16, fmt=fmt), gpu).ok
    why = Q.supports(QuantGemv(M=16385, N=131072, K=4096, dtype=DType.float16, fmt=fmt), gpu)
    assert not why.ok and "split M into chunks of at most 16384 rows" in why.reason
    wide_x = QuantGemv(M=65537, N=4096, K=16384, dtype=DType.float16, fmt=fmt, prologue="silu_mul")
    assert "x of 32768" in Q.supports(wide_x, gpu).reason


@pytest.mark.interpreter
def test_gemv_x_view_with_rows_2_31_elements_apart_gives_the_contiguous_result():
    """Row 2 of x starts past 2^31 elements: the kernel's 32-bit ``row * stride_xm`` wrapped (the interpreter
    crashed on the wrapped address); the host now copies such a view to contiguous rows."""
    import portakern

    w, _ = _case(128)
    x = _rows_apart(3, K)
    x.copy_(torch.randn(3, K, dtype=torch.float16, generator=torch.Generator().manual_seed(3)))
    want = portakern.quant_gemv(x.contiguous(), w, backend="cpu")
    got = portakern.quant_gemv(x, w, backend="triton")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-3)


@pytest.mark.interpreter
def test_gemv_output_view_with_rows_2_31_elements_apart_is_refused():
    """The output cannot be copied back without a second kernel: the error names the rule and the way out."""
    from portakern.backends.triton import quant_gemv as Q

    w, p = _case(128)
    kern = Q.compile(QuantGemv(M=3, N=N, K=K, dtype=DType.float16, fmt=w.fmt), CPU)
    x = torch.randn(3, K, dtype=torch.float16)
    kern(x, p, torch.empty(3, N, dtype=torch.float16))
    with pytest.raises(InvalidInputError, match=r"out has row stride \d+: its 3 rows span .* past the 2\^31 .* "
                                                r"pass a contiguous out"):
        kern(x, p, _rows_apart(3, N))
