"""GGUF K-quants (Q4_K, Q5_K, Q6_K) in the opencl backend's quantized GEMV, on the OpenCL device (PoCL in CI) and
from host arrays, against gguf-py's dequantizer (``gguf.quants.dequantize``) in float64.

The weights are whole super-blocks of two kinds, rows of one weight: blocks quantized from a float weight (gguf-py's
quantizer where it has one for the type, else ``portakern.ir.gguf_kquants.quantize``) and random bytes with
super-scales of either sign (every bit of the 6-bit scales and minimums, and of the codes, set somewhere). The
bound of a result is a float32 error bound of the kernel's sums: ``64 * 2^-24 * sum_k |x_k| (|s| |q - z| + |min|)``
(a group's dot product, a work-item's groups, the work-group's tree: fewer than 64 roundings deep), plus the
output's rounding to float16 / bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern
from portakern.errors import InvalidInputError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import gguf_kquants as KQ
from portakern.ir.ops import QuantGemv
from portakern.quantized import QuantizedWeight

from opencl_helpers import require_opencl, to_cl

gguf = pytest.importorskip("gguf")

#: name -> (packing, bits, group, symmetric)
KQUANTS = {"Q4_K": (Packing.GGUF_Q4_K, 4, 32, False), "Q5_K": (Packing.GGUF_Q5_K, 5, 32, False),
           "Q6_K": (Packing.GGUF_Q6_K, 6, 16, True)}
OUT_ROUNDING = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@pytest.fixture(scope="module")
def cl_dev():
    return require_opencl()


def quantized_blocks(name: str, w: np.ndarray) -> np.ndarray:
    """``w (N, K)`` as K-quant blocks: gguf-py's quantizer where it implements the type, else portakern's."""
    try:
        return np.asarray(gguf.quants.quantize(w.astype(np.float32), getattr(gguf.GGMLQuantizationType, name)))
    except NotImplementedError:
        return KQ.quantize(KQUANTS[name][0], w)


def random_blocks(name: str, N: int, K: int, rng) -> np.ndarray:
    """Blocks of random bytes whose float16 super-scales are redrawn finite, of either sign, in 2^-8 .. 2^-3 (the
    results fit float16)."""
    packing = KQUANTS[name][0]
    raw = rng.integers(0, 256, (N, K // 256 * KQ.BLOCK_BYTES[packing]), dtype=np.uint8)
    fields = KQ.unpack_fields(packing, raw, N, K)
    for key in ("d", "dmin") if "dmin" in fields else ("d",):
        fields[key] = rng.uniform(-2, 2, (N, K // 256)) * 2.0 ** rng.integers(-8, -3, (N, K // 256))
    return KQ.pack_fields(packing, fields, N, K)


def make_weight(name: str, N: int, K: int, rng) -> tuple[QuantizedWeight, np.ndarray, np.ndarray]:
    """A host ``QuantizedWeight`` of ``N`` rows (quantized ones, then random-byte ones), its float64 weight from
    gguf-py's dequantizer, and ``|s| |q - z| + |min|`` per weight (float64, for the error bound)."""
    packing, bits, group, sym = KQUANTS[name]
    half = N // 2
    data = np.concatenate([quantized_blocks(name, rng.standard_normal((half, K)) * 0.1),
                           random_blocks(name, N - half, K, rng)])
    w64 = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, name)).astype(np.float64)
    codes, scales, zeros, mins = KQ.affine(packing, data, N, K)
    g = np.arange(K) // group
    mag = np.abs(scales[:, g]) * np.abs(codes - zeros[:, g]) + np.abs(mins[:, g])
    return QuantizedWeight(QuantFormat(bits, group, sym, packing), N, K, {"data": data}), w64, mag


def check(y, x64, w64, mag, dtype: str) -> None:
    """``y`` (float64) against ``x64 @ w64.T`` within the float32 error bound of the kernel's sums."""
    ref = x64 @ w64.T
    tol = 64 * 2.0 ** -24 * (np.abs(x64) @ mag.T) + OUT_ROUNDING[dtype] * np.abs(ref) + 1e-30
    assert not np.isnan(y).any(), "an output element was left unwritten (NaN)"
    err = np.abs(y - ref)
    assert (err <= tol).all(), f"max error {err.max():.3g} (at {np.unravel_index(err.argmax(), err.shape)}), " \
                               f"bound there {tol.flat[err.argmax()]:.3g}"


@pytest.mark.parametrize("M", [1, 19])                     # 19: more rows than one work-group's block of 16
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("where", ["opencl:0", "host"])
@pytest.mark.parametrize("name", list(KQUANTS))
def test_values_match_gguf_dequantizer(cl_dev, rng, name, where, dtype, M):
    """portakern.quant_gemv(backend="opencl") on pyopencl arrays of opencl:0, and on host numpy arrays (copied to the
    device and back), outputs NaN-poisoned first: every element written, within the bound of the float64 product."""
    dev, queue = cl_dev
    N, K = 37, 768
    w, w64, mag = make_weight(name, N, K, rng)
    x = rng.standard_normal((M, K)).astype(dtype)
    xd, wd = (to_cl(queue, x), w.to(str(dev))) if where == "opencl:0" else (x, w)
    assert portakern.explain(portakern.quant_gemv, xd, wd, backend="opencl").chosen == "opencl"
    with portakern.dispatch.poison_outputs():
        y = portakern.quant_gemv(xd, wd, backend="opencl")
    y = y.get() if where == "opencl:0" else y
    assert y.dtype == np.dtype(dtype) and y.shape == (M, N)
    check(y.astype(np.float64), x.astype(np.float64), w64, mag, dtype)


@pytest.mark.parametrize("name", list(KQUANTS))
def test_host_torch_bfloat16(cl_dev, rng, name):
    """CPU torch bfloat16 x travels to the device as float32 (exact) and the result is rounded back to bfloat16."""
    torch = pytest.importorskip("torch")
    w, w64, mag = make_weight(name, 9, 512, rng)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32)).to(torch.bfloat16)
    with portakern.dispatch.poison_outputs():
        y = portakern.quant_gemv(x, w, backend="opencl")
    assert y.dtype == torch.bfloat16 and y.shape == (3, 9)
    check(y.float().numpy().astype(np.float64), x.float().numpy().astype(np.float64), w64, mag, "bfloat16")


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_silu_mul_prologue(cl_dev, rng, name):
    """The group sums of the float minimums are taken over silu(gate) * up, the GEMV's input."""
    dev, queue = cl_dev
    w, w64, mag = make_weight(name, 11, 512, rng)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    y = portakern.quant_gemv(to_cl(queue, x), w.to(str(dev)), prologue="silu_mul", backend="opencl").get()
    g, u = x[:, :512].astype(np.float64), x[:, 512:].astype(np.float64)
    check(y.astype(np.float64), g / (1 + np.exp(-g)) * u, w64, mag, "float32")


@pytest.mark.parametrize("cap", [1, 8])
@pytest.mark.parametrize("name", list(KQUANTS))
def test_kernel_writes_every_element_of_a_nan_filled_out(cl_dev, rng, name, cap):
    """The kernel called directly on a NaN-filled ``out``, on devices allowing 1 or 8 work-items per group (fewer
    work-items than groups: each takes several), M = 1 and M above the row block."""
    from dataclasses import replace

    import pyopencl.array as cla

    from portakern.backends.opencl import quant_gemv as Q

    dev, queue = cl_dev
    small = replace(dev, info=tuple((k, str(cap) if k == "max_work_group_size" else v) for k, v in dev.info))
    w, w64, mag = make_weight(name, 13, 512, rng)
    prepared = Q.prepare_weight(w, dev)
    for M in (1, cap + 3):
        x = rng.standard_normal((M, 512)).astype(np.float32)
        out = cla.empty(queue, (M, 13), np.float32)
        out.fill(np.float32(np.nan))
        Q.compile(QuantGemv(M, 13, 512, DType.float32, w.fmt), small)(to_cl(queue, x), prepared, out)
        check(out.get().astype(np.float64), x.astype(np.float64), w64, mag, "float32")


@pytest.mark.parametrize("name", list(KQUANTS))
def test_repacked_weight_is_exact(cl_dev, rng, name):
    """The prepared layout (codes, float32 scales ``d * sc``, float32 minimums ``dmin * m`` or zero point 32) holds
    gguf-py's float32 dequantization bit for bit."""
    from portakern.backends.opencl import quant_gemv as Q

    N, K = 6, 512
    w, _, _ = make_weight(name, N, K, rng)
    h = Q.prepare_weight(w, portakern.devices()[0]).host
    group = KQUANTS[name][2]
    c = h["codes"].astype(np.int64)
    codes = np.stack([c & 15, c >> 4], axis=-1).reshape(N, K) if name == "Q4_K" else c
    s = h["scales"].astype(np.float64).repeat(group, axis=1)
    if name == "Q6_K":
        assert h["mins"].shape == (1,) and (h["zeros"] == 32).all()
        w64 = (codes - 32) * s
    else:
        assert h["zeros"].shape == (1,) and h["mins"].dtype == np.float32
        w64 = codes * s - h["mins"].astype(np.float64).repeat(group, axis=1)
    theirs = gguf.quants.dequantize(w.tensors["data"], getattr(gguf.GGMLQuantizationType, name))
    np.testing.assert_array_equal(w64.astype(np.float32).view(np.uint32), theirs.view(np.uint32))


def test_supports_every_k_quant_on_the_device_and_refuses_bfloat16_there(cl_dev):
    dev, _ = cl_dev
    be = portakern.api.registry().get("opencl")
    for name, (packing, bits, group, sym) in KQUANTS.items():
        fmt = QuantFormat(bits, group, sym, packing)
        for M, dtype in ((1, "float32"), (40, "float16")):
            assert be.supports(QuantGemv(M, 8, 512, DType(dtype), fmt), dev), name
            assert be.supports(QuantGemv(M, 8, 512, DType(dtype), fmt, prologue="silu_mul"), dev), name
        s = be.supports(QuantGemv(1, 8, 512, DType.bfloat16, fmt), dev)
        assert not s and "bfloat16" in s.reason and "backend='opencl'" in s.reason


def test_bad_inputs_raise_naming_the_problem(cl_dev, rng):
    """Through the API: x of the wrong width or dtype, mixed array kinds; at the kernel: a weight prepared for
    another format, x of the wrong dtype, an ``out`` that is not contiguous."""
    import pyopencl.array as cla

    from portakern.backends.opencl import quant_gemv as Q
    from portakern.errors import InvalidTypeError

    dev, queue = cl_dev
    w4, _, _ = make_weight("Q4_K", 8, 512, rng)
    w5, _, _ = make_weight("Q5_K", 8, 512, rng)
    wd = w4.to(str(dev))
    with pytest.raises(InvalidInputError, match="512"):
        portakern.quant_gemv(to_cl(queue, np.zeros((2, 256), np.float32)), wd, backend="opencl")
    with pytest.raises((InvalidInputError, InvalidTypeError), match="int32"):
        portakern.quant_gemv(to_cl(queue, np.zeros((2, 512), np.int32)), wd, backend="opencl")
    with pytest.raises((InvalidInputError, InvalidTypeError), match=r"is on opencl:0 but x is on cpu.*w\.to"):
        portakern.quant_gemv(np.zeros((2, 512), np.float32), wd, backend="opencl")
    with pytest.raises(InvalidInputError, match="multiple of 256"):
        QuantizedWeight(QuantFormat(4, 32, False, Packing.GGUF_Q4_K), 8, 480, {"data": np.zeros((8, 270), np.uint8)})

    kernel = Q.compile(QuantGemv(2, 8, 512, DType.float32, w4.fmt), dev)
    x, out = to_cl(queue, np.zeros((2, 512), np.float32)), cla.empty(queue, (2, 8), np.float32)
    with pytest.raises(InvalidInputError, match="weight does not match the op"):
        kernel(x, Q.prepare_weight(w5, dev), out)
    with pytest.raises(InvalidInputError, match="dtype"):
        kernel(to_cl(queue, np.zeros((2, 512), np.float16)), Q.prepare_weight(w4, dev), out)
    with pytest.raises(InvalidInputError, match="contiguous"):
        kernel(x, Q.prepare_weight(w4, dev), cla.empty(queue, (8, 2), np.float32).T)
