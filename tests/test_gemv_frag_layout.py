"""The fragment layout of the tensor-core GEMV kernel "frag" (``portakern.ir.gemv_layout.pack_fragments``) and its
place in the tuning table, on the CPU.

The layout is checked against an emulation of ``mma.m16n8k16`` written from the PTX ISA's fragment
tables (A: register 0 = row g, k 2t..2t+1; register 1 = row g + 8; registers 2 and 3 the same rows at
k + 8; B: k 2t..2t+1 and 2t+8..2t+9 of column g), not from the packing code, so a layout that only
round-trips with its own unpacker fails here. The kernel itself runs in the GPU tests
(``test_triton_gemv.py -k gpu``) and is lowered for sm_80 / sm_90a / sm_100a in the compile cases.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("triton")

from portakern.backends.triton import gemv_tuning as T  # noqa: E402
from portakern.backends.triton import quant_gemv as Q  # noqa: E402
from portakern import gemv_weight  # noqa: E402
from portakern.gemv_weight import prepare_gemv_weight  # noqa: E402
from portakern.ir import gemv_layout  # noqa: E402


def _kcol(kk: int, p: int) -> int:
    """The documented column map of kernels/gemv_frag.py: MMA k position kk of step p."""
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
                        for reg, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
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
    words = gemv_layout.pack_fragments(codes, gemv_layout.N_ALIGN_WORDS)
    assert words.shape == (K // 128, -(-N // 128) * 8, 256) and words.dtype == np.int32
    np.testing.assert_allclose(_emulate(words, x, N), codes @ x.T, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("N,K", [(1, 128), (200, 640), (129, 128)])
def test_fragment_layout_round_trips_and_pads_with_zero_codes(N, K):
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    words = gemv_layout.pack_fragments(codes, gemv_layout.N_ALIGN_WORDS)
    np.testing.assert_array_equal(gemv_layout.unpack_fragments(words, N, K), codes)
    full = gemv_layout.unpack_fragments(words, words.shape[1] * 16, words.shape[0] * 128)
    assert not full[N:].any() and not full[:, K:].any(), "padding rows / columns must hold code 0"


@pytest.mark.parametrize("bits,gs,perm,irregular,needle", [
    (8, 128, False, False, "bits=8"),
    (4, 64, False, False, "group_size=64"),
    (4, 32, False, False, "group_size=32"),
    (4, 128, True, False, "act-order"),
    (4, 128, False, True, "act-order"),
])
def test_frag_eligibility_names_the_reason(bits, gs, perm, irregular, needle):
    why = gemv_layout.frag_eligible(bits, gs, perm, irregular)
    assert why is not None and needle in why
    assert gemv_layout.frag_eligible(4, 128, False, False) is None and gemv_layout.frag_eligible(4, 256, False, False) is None


def _layout(N=4096, K=4096, gs=128, frag=True, bits=4):
    """The layout facts the table reads (as a prepared weight has them)."""
    epw = 32 // bits
    return SimpleNamespace(bits=bits, group_size=gs, N=N, K=K, codes_per_word=epw, KWP=-(-K // epw // 64) * 64,
                           stride_qk=-(-N // 128) * 128, has_z=True, has_perm=False, kgroup=None, zero_point=8,
                           per_elem_group=False, interleave=8, frag=object() if frag else None)


@pytest.mark.parametrize("M", [2, 4, 8, 9, 16])
def test_table_takes_frag_for_bf16_small_m_on_gpus(M):
    cfg = T.choose(_layout(), M, 4096, "sm_90", 132, dtype="bfloat16")
    assert cfg.kind == "frag" and cfg.block_n == 64 and cfg.num_warps == 2
    assert cfg.pdl      # H200 session 21 sweep: with PDL best or within noise on 10 of 12 shapes
    assert not T.choose(_layout(), M, 4096, "sm_80", 108, dtype="bfloat16").pdl    # no griddepcontrol there
    assert T.block_m("frag", M) == (8 if M <= 8 else 16)


@pytest.mark.parametrize("M,dtype,layout,kind", [
    (1, "bfloat16", _layout(), "fma"),                 # M=1 stays on the CUDA-core kernel
    (16, "float16", _layout(), "mma"),                 # the kernel is bf16-only
    (16, "float32", _layout(), "dot"),
    (16, "bfloat16", _layout(frag=False), "mma"),      # a weight prepared without the layout
    (17, "bfloat16", _layout(), "mma"),                # more rows than one MMA column tile
])
def test_table_keeps_other_kernels_where_frag_cannot_serve(M, dtype, layout, kind):
    assert T.choose(layout, M, 4096, "sm_90", 132, dtype=dtype).kind == kind
    assert T.choose(_layout(), 16, 4096, "interp", 4, dtype="bfloat16").kind != "frag"


@pytest.mark.parametrize("N,K,M,split", [
    # H200 session 7 sweep winners (benchmarks/gemv_notes.md v9)
    (4096, 4096, 16, 8), (14336, 4096, 16, 4), (28672, 4096, 16, 2), (4096, 14336, 16, 8),
    (4096, 4096, 4, 16), (14336, 4096, 4, 8), (128256, 4096, 16, 1),
])
def test_frag_split_follows_the_sweep(N, K, M, split):
    cfg = T.choose(_layout(N, K), M, N, "sm_90", 132, dtype="bfloat16")
    assert cfg.split_k == split
    assert cfg.block_n == (256 if N >= T.FRAG_WIDE_MIN_N else 64)


def test_frag_takes_taller_programs_for_the_largest_weights_above_eight_rows():
    cfg = T.choose(_layout(16384, 16384), 16, 16384, "sm_90", 132, dtype="bfloat16")
    assert (cfg.block_n, cfg.num_warps, cfg.split_k) == (128, 4, 4)      # the sweep's 58.4 / 61.4 us entry
    cfg = T.choose(_layout(16384, 16384), 4, 16384, "sm_90", 132, dtype="bfloat16")
    assert (cfg.block_n, cfg.num_warps) == (64, 2)                        # M <= 8 keeps the benched entry


def test_forced_frag_config_is_fitted_or_refused_with_the_reason():
    c = T.fit(T.GemvConfig("frag", block_n=200, block_kw=8, num_warps=3), _layout(N=4000), 4)
    assert (c.block_n, c.num_warps, c.block_kw) == (256, 4, 32)
    c = T.fit(T.GemvConfig("frag", block_n=200, block_kw=8, num_warps=3), _layout(N=100), 4)   # 128 padded rows
    assert (c.block_n, c.num_warps) == (128, 4)
    with pytest.raises(ValueError, match="no fragment layout"):
        T.fit(T.GemvConfig("frag", 64, 32, 2), _layout(frag=False), 4)
    with pytest.raises(ValueError, match="M=17"):
        T.fit(T.GemvConfig("frag", 64, 32, 2), _layout(), 17)
    assert "dtype=float16" in T.frag_usable(_layout(), 4, "float16")
    with pytest.raises(ValueError, match="frag_split"):
        T.split_k_for(4096, 512, T.GemvConfig("frag", 64, 32, 2), 132)


def test_prepared_weight_on_cpu_has_no_fragment_layout():
    import portakern
    from portakern.devices import Device

    w = portakern.quantize(np.random.default_rng(0).standard_normal((64, 256)), bits=4, group_size=128)
    p = prepare_gemv_weight(w, Device("cpu", 0))
    assert p.frag is None and "frag" not in p.tensors()


def test_without_gluon_no_weight_gets_the_layout_and_the_table_keeps_mma(monkeypatch):
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=16, N=4096, K=4096, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    from portakern.devices import Device

    gpu = Device("cuda", 0, "GPU 0")
    assert Q.frag_kernel_available() and Q._LayoutStub(op).frag is not None   # Triton >= 3.5 here
    assert gemv_weight.wants_fragments(gpu)
    # a Triton without Gluon's Ampere MMA: its import fails, and the probe (cached per process) is asked again
    gemv_weight.fragment_kernel_available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon.language.nvidia.ampere", None)
    try:
        assert not gemv_weight.wants_fragments(gpu)     # what every backend of the layout prepares
        stub = Q._LayoutStub(op)
        assert stub.frag is None
        assert T.choose(stub, 16, 4096, "sm_90", 132, dtype="bfloat16").kind == "mma"
    finally:
        monkeypatch.undo()
        gemv_weight.fragment_kernel_available.cache_clear()
    assert gemv_weight.wants_fragments(gpu)
