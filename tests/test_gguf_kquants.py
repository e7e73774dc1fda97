"""GGUF K-quant packings (Q4_K, Q5_K, Q6_K) against gguf-py's dequantizers and a per-weight formula.

References: ``gguf.quants.dequantize`` (float32, bit for bit), and a scalar decoder written here from the byte
layout documented in ``portakern.ir.gguf_kquants`` (one weight at a time, plain Python ints and floats).
"""

from __future__ import annotations

import numpy as np
import pytest

from portakern.errors import InvalidInputError
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir import gguf_kquants as KQ
from portakern.ir import packing as P
from portakern.quantized import QuantizedWeight

gguf = pytest.importorskip("gguf")

KQUANTS = {"Q4_K": (Packing.GGUF_Q4_K, 4, 32, False), "Q5_K": (Packing.GGUF_Q5_K, 5, 32, False),
           "Q6_K": (Packing.GGUF_Q6_K, 6, 16, True)}


def fmt_of(name: str) -> QuantFormat:
    packing, bits, group, sym = KQUANTS[name]
    return QuantFormat(bits, group, sym, packing)


def random_blocks(name: str, N: int, K: int, seed: int) -> np.ndarray:
    """Random bytes with finite float16 super-scales of either sign (every other byte pattern is a valid block)."""
    packing = KQUANTS[name][0]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N, K // 256, KQ.BLOCK_BYTES[packing]), dtype=np.uint8)
    scales = rng.uniform(-4, 4, (N, K // 256, 2)) * 2.0 ** rng.integers(-14, 8, (N, K // 256, 2))
    f16 = scales.astype("<f2").view(np.uint8).reshape(N, K // 256, 4)
    if packing is Packing.GGUF_Q6_K:
        b[..., 208:210] = f16[..., :2]
    else:
        b[..., 0:4] = f16
    return b.reshape(N, -1)


def scalar_decode(name: str, block: bytes, e: int) -> float:
    """Weight ``e`` (0..255) of one super-block, decoded one bit at a time from the documented layout."""
    f16 = lambda off: float(np.frombuffer(block[off:off + 2], "<f2")[0])  # noqa: E731
    if name == "Q6_K":
        h, r = divmod(e, 128)
        low = block[64 * h + r] & 15 if r < 64 else block[64 * h + r - 64] >> 4
        high = (block[128 + 32 * h + r % 32] >> (2 * (r // 32))) & 3
        sc = int(np.frombuffer(block[192 + e // 16:193 + e // 16], np.int8)[0])
        return f16(208) * sc * ((low | high << 4) - 32)
    s = block[4:16]
    j = e // 32
    if j < 4:
        sc, m = s[j] & 63, s[j + 4] & 63
    else:
        sc, m = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, (s[j + 4] >> 4) | (s[j] >> 6) << 4
    c, i = divmod(e, 64)
    qs = block[16:144] if name == "Q4_K" else block[48:176]
    q = qs[32 * c + i % 32] >> (4 * (i // 32)) & 15
    if name == "Q5_K":
        q |= ((block[16 + e % 32] >> (e // 32)) & 1) << 4
    return f16(0) * sc * q - f16(2) * m


@pytest.mark.parametrize("name", list(KQUANTS))
def test_dequantize_matches_gguf_py_bit_exactly(name):
    N, K = 6, 512
    data = random_blocks(name, N, K, seed=3)
    T = getattr(gguf.GGMLQuantizationType, name)
    theirs = gguf.quants.dequantize(data, T)
    assert theirs.dtype == np.float32
    ours = QuantizedWeight(fmt_of(name), N, K, {"data": data}).dequantize()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # float64 holds every value exactly: the reference's float64 result rounds to the same float32
    np.testing.assert_array_equal(P.dequantize(fmt_of(name), {"data": data}, N, K).astype(np.float32), theirs)


@pytest.mark.parametrize("name", list(KQUANTS))
def test_dequantize_matches_scalar_decoder(name):
    N, K = 2, 256
    data = random_blocks(name, N, K, seed=11)
    ours = P.dequantize(fmt_of(name), {"data": data}, N, K)
    for n in range(N):
        block = data[n].tobytes()
        for e in range(0, 256, 7):
            assert ours[n, e] == scalar_decode(name, block, e), (n, e)


@pytest.mark.parametrize("name", list(KQUANTS))
def test_fields_round_trip_both_ways(name):
    packing = KQUANTS[name][0]
    N, K = 3, 768
    data = random_blocks(name, N, K, seed=5)
    fields = KQ.unpack_fields(packing, data, N, K)
    np.testing.assert_array_equal(KQ.pack_fields(packing, fields, N, K), data)
    again = KQ.unpack_fields(packing, KQ.pack_fields(packing, fields, N, K), N, K)
    for k in fields:
        np.testing.assert_array_equal(again[k].view(np.uint8), fields[k].view(np.uint8))


@pytest.mark.parametrize("name", list(KQUANTS))
def test_quantize_error_bound_and_requantize(name):
    packing, bits, group, _ = KQUANTS[name]
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, (8, 1))
    w[0, :256] = 0.0                                         # an all-zero super-block
    data = KQ.quantize(packing, w)
    assert data.shape == (8, 2 * KQ.BLOCK_BYTES[packing]) and data.dtype == np.uint8
    deq = P.dequantize(fmt_of(name), {"data": data}, 8, 512)
    np.testing.assert_array_equal(deq[0, :256], 0.0)
    np.testing.assert_array_equal(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, name)),
                                  deq.astype(np.float32))
    # the error per group: at most half a step plus the rounding of the 6-bit minimum up to a whole dmin
    codes, scales, zeros, mins, group_of = P.unpack_affine(fmt_of(name), {"data": data}, 8, 512)
    f = KQ.unpack_fields(packing, data, 8, 512)
    slack = 0.0 if "dmin" not in f else np.repeat(f["dmin"].astype(np.float64), 256 // group, axis=1)
    bound = scales / 2 + slack + 1e-12
    err = np.abs(deq - w).reshape(8, -1, group).max(axis=-1)
    assert (err <= bound).all(), float((err - bound).max())
    # requantizing the dequantized weight is a fixed point of the values (not necessarily of the bytes)
    assert np.abs(P.dequantize(fmt_of(name), {"data": KQ.quantize(packing, deq)}, 8, 512) - deq).max() <= \
        np.abs(deq - w).max() + 1e-12


def test_unpack_refuses_float_minimums_and_unpack_affine_reads_them():
    data = random_blocks("Q4_K", 2, 256, seed=1)
    fmt = fmt_of("Q4_K")
    with pytest.raises(InvalidInputError, match="float minimum per group.*unpack_affine"):
        P.unpack(fmt, {"data": data}, 2, 256)
    codes, scales, zeros, mins, group = P.unpack_affine(fmt, {"data": data}, 2, 256)
    f = KQ.unpack_fields(Packing.GGUF_Q4_K, data, 2, 256)
    np.testing.assert_array_equal(mins, (f["dmin"].astype(np.float64)[..., None] * f["m"]).reshape(2, 8))
    np.testing.assert_array_equal(zeros, 0.0)
    # Q6_K has integer zero points: unpack reads it, with zeros 32 and scales d * sc
    d6 = random_blocks("Q6_K", 2, 256, seed=2)
    c6, s6, z6, g6 = P.unpack(fmt_of("Q6_K"), {"data": d6}, 2, 256)
    np.testing.assert_array_equal(z6, 32.0)
    np.testing.assert_array_equal(g6, np.arange(256) // 16)


@pytest.mark.parametrize("name", list(KQUANTS))
def test_pack_refuses_kquants_naming_the_writers(name):
    with pytest.raises(InvalidInputError, match="pack_fields"):
        P.pack(fmt_of(name), np.zeros((1, 256), int), np.ones((1, 256 // KQUANTS[name][2])), None, 1, 256)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=4, group_size=32, symmetric=True, packing=Packing.GGUF_Q4_K), "symmetric=True is impossible"),
    (dict(bits=6, group_size=32, symmetric=True, packing=Packing.GGUF_Q6_K), "group_size=32 must be 16"),
    (dict(bits=4, group_size=32, symmetric=False, packing=Packing.GGUF_Q5_K), "bits=4 is not supported"),
])
def test_format_rules(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        QuantFormat(**kwargs).verify(K=256)


def test_k_must_be_whole_super_blocks():
    with pytest.raises(InvalidInputError, match="K=288 must be a multiple of 256 for gguf_q4_k"):
        fmt_of("Q4_K").verify(K=288)
    with pytest.raises(InvalidInputError, match=r"\(N, K // 256 \* 144\)"):
        QuantizedWeight(fmt_of("Q4_K"), 2, 256, {"data": np.zeros((2, 143), np.uint8)})


def test_q6_k_repack_to_native_int8_is_exact():
    data = random_blocks("Q6_K", 4, 512, seed=9)
    t = KQ.q6_k_to_native(data, 4, 512)
    native = QuantFormat(8, 16, False, Packing.NATIVE, scale_dtype=DType.float32)
    np.testing.assert_array_equal(P.dequantize(native, t, 4, 512), P.dequantize(fmt_of("Q6_K"), {"data": data}, 4, 512))


@pytest.mark.parametrize("name,bits_flag", [("gguf_q4_k", None), ("gguf_q6_k", None), ("gguf_q5_k", "4")])
def test_cli_explain_takes_the_fixed_layout(capsys, name, bits_flag):
    """``--packing gguf_q*_k`` takes its bits and group size from the packing (a conflicting --bits is a usage
    error); the triton backends refuse the CPU only for want of the interpreter, not for the format."""
    from portakern import cli

    argv = ["explain", "quant_gemv", "--packing", name, "--shape", "1,64,256", "--dtype", "float32"]
    if bits_flag:
        assert cli.main(argv + ["--bits", bits_flag]) == 2
        assert "packing gguf_q5_k is always 5 bits" in capsys.readouterr().err
        return
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen   cpu" in out
    for backend in ("triton", "triton-rocm"):
        line = next(line for line in out.splitlines() if line.strip().startswith(backend + " "))
        assert "TRITON_INTERPRET=1" in line or "unavailable" in line, line


def test_zero_points_mins_and_json():
    assert fmt_of("Q6_K").zero_point == 32 and not fmt_of("Q6_K").has_mins
    assert fmt_of("Q4_K").zero_point == 0 and fmt_of("Q4_K").has_mins and fmt_of("Q5_K").has_mins
    assert not QuantFormat(4, 32, True, Packing.GGUF_Q4_0).has_mins
    for name in KQUANTS:
        assert QuantFormat.from_json(fmt_of(name).to_json()) == fmt_of(name)
