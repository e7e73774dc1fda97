"""The GEMV weight layout (``portakern.ir.gemv_layout``) and the prepared weight built in it
(``portakern.gemv_weight``), on the CPU, without any backend.

The word layout is checked bit by bit against the formula its docstring states and the fragment layout against
an emulation of ``mma.m16n8k16`` written from the PTX ISA's fragment tables (A: register 0 = row g, k 2t..2t+1;
register 1 = row g + 8; registers 2 and 3 the same rows at k + 8; B: k 2t..2t+1 and 2t+8..2t+9 of column g),
not from the packing code, so a layout that only round-trips with its own unpacker fails here. The kernels that
read it run in the backends' tests.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gemv_cases import CASES, weight

from portakern import gemv_weight
from portakern.devices import CPU, Device
from portakern.ir import gemv_layout as L
from portakern.ir.packing import dequantize

# -- the word layout -------------------------------------------------------------------------------


def test_interleave_is_the_largest_power_of_two_within_a_group_for_int4_only():
    assert [L.interleave_words(4, g, False) for g in (128, 64, 32, 16, 8, 296, 12)] == [8, 8, 4, 2, 1, 1, 1]
    assert [L.interleave_words(8, g, False) for g in (128, 32, 8, 6)] == [1, 1, 1, 1]   # int8: plain order
    assert L.interleave_words(4, 128, True) == 1                                       # irregular groups
    assert L.interleave_words(4, 1024, False) == L.MAX_INTERLEAVE == 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("iw", [1, 2, 4, 8])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 200), (129, 67), (17, 1031)])
def test_words_hold_each_code_where_the_formula_says_and_round_trip(bits, iw, N, K):
    """Code e of word row j, column n is W[n, (j // iw) * iw * epw + e * iw + j % iw] (0 past K and past N),
    the shape is padded to (KWP, NP), and ``unpack_internal`` gives the codes back."""
    rng = np.random.default_rng(bits * 1000 + iw * 100 + N + K)
    codes = rng.integers(0, 1 << bits, (N, K))
    words = L.pack_internal(codes, bits, iw)
    epw = 32 // bits
    kwp = -(-(-(-K // epw)) // L.K_ALIGN_WORDS) * L.K_ALIGN_WORDS
    np_ = -(-N // L.N_ALIGN_WORDS) * L.N_ALIGN_WORDS
    assert words.dtype == np.int32 and words.shape == (kwp, np_) == (L.padded_rows(K, bits), L.padded_columns(N))
    u = words.view(np.uint32)
    j = np.arange(kwp)[:, None]
    for e in range(epw):
        k = (j // iw) * iw * epw + e * iw + j % iw                                    # (KWP, 1)
        got = (u >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1)                  # (KWP, NP)
        want = np.zeros((kwp, np_), dtype=np.int64)
        inside = (k < K)[:, 0]
        want[inside, :N] = codes[:, k[inside, 0]].T
        np.testing.assert_array_equal(got, want, err_msg=f"bits={bits} iw={iw} e={e}")
    np.testing.assert_array_equal(L.unpack_internal(words, bits, iw, N, K), codes)


def test_int8_words_are_little_endian_bytes_along_k():
    """A literal check of the plain order: int8 codes 1, 2, 3, 4 along K are the word 0x04030201."""
    words = L.pack_internal(np.array([[1, 2, 3, 4, 5]]), 8, 1).view(np.uint32)
    assert words[0, 0] == 0x04030201 and words[1, 0] == 5 and not words[:, 1:].any() and not words[2:].any()


# -- the fragment layout ---------------------------------------------------------------------------

def _kcol(kk: int, p: int) -> int:
    """The documented column map of the fragment layout: MMA k position kk of step p."""
    t = (kk % 8) // 2
    return 16 * t + 4 * p + 2 * (kk // 8) + kk % 2


def _emulate(words: np.ndarray, x: np.ndarray, N: int) -> np.ndarray:
    """``codes @ x.T`` computed the way the kernel's MMAs see the words: for every unit and k16 step,
    the A fragment each lane holds (PTX register order) times the B fragment of x."""
    kc, nu, _ = words.shape
    M = x.shape[0]
    u32 = words.view(np.uint32)
    y = np.zeros((nu * 16, M))
    for c in range(kc):
        for u in range(nu):
            for h in range(2):
                blk = u32[c, u, 128 * h: 128 * (h + 1)].reshape(32, 4)   # (lane, reg)
                for p in range(4):
                    A = np.zeros((16, 16))
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for reg, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                                         (g + 8, 2 * t + 8))):
                            w = int(blk[lane, reg])
                            A[row, k0] = (w >> (4 * p)) & 15
                            A[row, k0 + 1] = (w >> (16 + 4 * p)) & 15
                    B = np.array([[x[m, 128 * c + 64 * h + _kcol(kk, p)] for m in range(M)] for kk in range(16)])
                    y[16 * u: 16 * u + 16] += A @ B
    return y[:N]


@pytest.mark.parametrize("N,K", [(16, 128), (40, 256), (130, 384)])
def test_fragment_layout_is_what_the_mma_reads(N, K):
    rng = np.random.default_rng(N + K)
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    x = rng.standard_normal((3, K))
    words = L.pack_fragments(codes, L.N_ALIGN_WORDS)
    assert words.shape == (K // 128, -(-N // 128) * 8, 256) and words.dtype == np.int32
    np.testing.assert_allclose(_emulate(words, x, N), codes @ x.T, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("N,K", [(1, 128), (200, 640), (129, 128), (33, 200), (7, 1)])
def test_fragment_layout_round_trips_and_pads_with_zero_codes(N, K):
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    words = L.pack_fragments(codes, L.N_ALIGN_WORDS)
    assert words.shape == (-(-K // L.FRAG_CHUNK), L.padded_columns(N) // 16, 256)
    np.testing.assert_array_equal(L.unpack_fragments(words, N, K), codes)
    full = L.unpack_fragments(words, words.shape[1] * 16, words.shape[0] * 128)
    assert not full[N:].any() and not full[:, K:].any(), "padding rows / columns must hold code 0"


def test_fragment_rows_pad_to_the_alignment_asked_for():
    codes = np.random.default_rng(1).integers(0, 16, size=(20, 128))
    words = L.pack_fragments(codes, 16)
    assert words.shape == (1, 2, 256)
    np.testing.assert_array_equal(L.unpack_fragments(words, 20, 128), codes)


@pytest.mark.parametrize("bits,gs,perm,irregular,needle", [
    (8, 128, False, False, "bits=8"),
    (4, 64, False, False, "group_size=64"),
    (4, 32, False, False, "group_size=32"),
    (4, 128, True, False, "act-order"),
    (4, 128, False, True, "act-order"),
])
def test_frag_eligibility_names_the_reason(bits, gs, perm, irregular, needle):
    why = L.frag_eligible(bits, gs, perm, irregular)
    assert why is not None and needle in why
    assert L.frag_eligible(4, 128, False, False) is None and L.frag_eligible(4, 256, False, False) is None


# -- the prepared weight ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if "config" not in c[9]], ids=lambda c: c[0])
def test_prepared_weight_dequantizes_as_the_reference(case):
    """Words, transposed scales and zeros (and the K permutation or group table of act-order) give back
    ``portakern.ir.packing.dequantize`` exactly, in every packing."""
    pytest.importorskip("torch")
    w = weight(case)
    p = gemv_weight.prepare_gemv_weight(w, CPU)
    codes = L.unpack_internal(p.qweight.numpy(), p.bits, p.interleave, p.N, p.K).astype(np.float64)
    assert p.qweight.shape == (L.padded_rows(w.K, w.fmt.bits), L.padded_columns(w.N))
    assert p.scales.shape[1] == L.padded_columns(w.N) and p.scales.dtype.is_floating_point
    g = p.kgroup.numpy() if p.kgroup is not None else np.arange(p.K) // p.group_size
    s = p.scales.float().numpy()[g, : p.N].T
    z = p.zeros.float().numpy()[g, : p.N].T if p.zeros is not None else p.zero_point
    ref = dequantize(w.fmt, w.tensors, w.N, w.K)
    np.testing.assert_array_equal((codes - z) * s, ref[:, p.perm.numpy()] if p.perm is not None else ref)
    assert (p.perm is not None) == (case[9].get("g_idx") == "actorder")
    assert (p.kgroup is not None) == (case[9].get("g_idx") == "random")
    assert p.frag is None and "frag" not in p.tensors()                  # a CPU device: no fragment copy


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("native4-asym-g128-m1-f16", "awq-g128-m8-f32",
                                                                  "native4-asym-g64-m1-f16-scalef32",
                                                                  "native8-asym-g64-m1-f32",
                                                                  "gptq-actorder-m2-f32")], ids=lambda c: c[0])
def test_fragment_copy_is_built_when_asked_for_the_formats_that_hold_one(case):
    pytest.importorskip("torch")
    w = weight(case)
    p = gemv_weight.prepare_gemv_weight(w, CPU, fragments=True, layout="words+fragments")   # both, to compare
    only = gemv_weight.prepare_gemv_weight(w, CPU, fragments=True)     # the default layout: "fragments"
    if L.frag_eligible(w.fmt.bits, w.fmt.group_size, p.perm is not None, p.kgroup is not None) is not None:
        assert p.frag is None and only.frag is None and only.qweight is not None   # no fragments: the words stay
        return
    codes = L.unpack_internal(p.qweight.numpy(), p.bits, p.interleave, p.N, p.K)
    np.testing.assert_array_equal(L.unpack_fragments(p.frag.numpy(), p.N, p.K), codes)
    assert p.frag.shape[1] * 16 == p.stride_qk and "frag" in p.tensors()
    assert only.qweight is None and np.array_equal(only.frag.numpy(), p.frag.numpy())     # each code held once
    assert p.key() != gemv_weight.prepare_gemv_weight(w, CPU).key() != only.key()    # launchers tell them apart


def test_every_backend_of_the_layout_builds_fragments_on_the_same_devices():
    """Backends of one layout share one cached copy, so whether it carries the fragment copy depends on the device
    (and this process's Triton) only."""
    pytest.importorskip("torch")
    gpu = Device("cuda", 0, "GPU 0")
    assert gemv_weight.wants_fragments(gpu) == gemv_weight.fragment_kernel_available()
    assert not gemv_weight.wants_fragments(CPU)


def test_gguf_q8_0_codes_and_zero_point_are_offset_to_unsigned():
    pytest.importorskip("torch")
    case = next(c for c in CASES if c[1] == "gguf_q8_0")
    p = gemv_weight.prepare_gemv_weight(weight(case), CPU)
    assert p.zero_point == 128 and p.zeros is None
    codes = L.unpack_internal(p.qweight.numpy(), p.bits, p.interleave, p.N, p.K)
    assert codes.min() >= 0 and codes.max() <= 255


def test_layout_and_prepared_weight_import_without_torch_or_a_backend():
    code = ("import sys; import portakern.ir.gemv_layout, portakern.gemv_weight, portakern.placement; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('portakern.backends.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
