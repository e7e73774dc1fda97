"""The GPU tables of the triton backend's quantized GEMV (``backends/triton/tuning.py``, read by
``quant_gemv/config.py``): which kernel and tile each shape gets on each architecture, and what ``fit`` guards.
Pure Python, no kernel runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_tables_use_group_resident_tiles_for_large_regular_int4_m1_and_fit_guards_them():
    """The GPU tables use group-resident tiles (``group_rows``) for int4 M=1 with regular whole-word
    groups and N*K > ROWS_MIN_NK, split so the grid holds WARPS_PER_SM_ROWS warps per SM with
    slices of >= 32 word rows (the H200 sweep's winners), and for int8 M=1 up to ROWS_INT8_MAX_NK (512
    columns); never for act-order, per-element groups, other int8 shapes, M > 1 or the interpreter. ``fit`` caps the tile at one group, clears the option for
    per-element groups and refuses it for the tensor-core kernel and two-deep prefetch."""
    from dataclasses import replace

    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv import aot as QA, autotune as GT
    from portakern.ir import DType, Packing, QuantFormat
    from portakern.ir.ops import QuantGemv

    def lay(N, K, M=1, bits=4, G=128, packing="native", act=False):
        fmt = QuantFormat(bits=bits, group_size=G, symmetric=False, packing=Packing(packing), has_g_idx=act)
        return QA.LayoutStub(QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=fmt))

    want = {(14336, 4096): (8, 16), (8192, 8192): (8, 32), (28672, 8192): (8, 16),
            (16384, 16384): (8, 16), (6144, 4096): (16, 16)}
    for (N, K), (bkw, split) in want.items():
        cfg = T.choose(lay(N, K), 1, N, "sm_90", 132, stream=False)   # sm_90 takes kind "stream" there
        assert (cfg.group_rows, cfg.block_n, cfg.block_kw, cfg.num_warps, cfg.split_k, cfg.pdl) == \
            (True, 256, bkw, 2, split, True), (N, K, cfg)
        assert T.choose(lay(N, K), 1, N, "sm_80", 108).group_rows
    assert not T.choose(lay(4096, 4096), 1, 4096, "sm_90", 132).group_rows     # below ROWS_MIN_NK
    # sm_90 below STREAM_MIN_N (SMALL_N_WORD_ROWS_ARCHS): the per-word-row tile of 64 x 32, split 8; sm_80 keeps
    # group-resident tiles there (16 rows, split 32)
    for N, K in ((4096, 14336), (4096, 8192)):
        cfg = T.choose(lay(N, K), 1, N, "sm_90", 132)
        assert (cfg.kind, cfg.group_rows, cfg.block_n, cfg.block_kw, cfg.num_warps, cfg.dq, cfg.pdl) == \
            ("fma", False, 64, 32, 4, 3, True), (N, K, cfg)
    assert T.choose(lay(4096, 14336), 1, 4096, "sm_90", 132).split_k == 8
    cfg = T.choose(lay(4096, 14336), 1, 4096, "sm_80", 108)
    assert (cfg.group_rows, cfg.block_n, cfg.block_kw, cfg.num_warps, cfg.split_k) == (True, 256, 16, 2, 32), cfg
    # int8: group-resident tiles of 512 columns up to ROWS_INT8_MAX_NK (8192^2, split 32), not above or below
    cfg = T.choose(lay(8192, 8192, bits=8), 1, 8192, "sm_90", 132)
    assert (cfg.group_rows, cfg.block_n, cfg.block_kw, cfg.num_warps, cfg.split_k) == (True, 512, 16, 2, 32), cfg
    assert not T.choose(lay(28672, 8192, bits=8), 1, 28672, "sm_90", 132).group_rows
    assert not T.choose(lay(4096, 4096, bits=8), 1, 4096, "sm_90", 132).group_rows
    assert not T.choose(lay(8192, 8192, packing="gptq", act=True), 1, 8192, "sm_90", 132).group_rows
    assert not T.choose(lay(8192, 8192, G=100), 1, 8192, "sm_90", 132).group_rows   # per-element groups
    assert not T.choose(lay(8192, 8192, M=2), 2, 8192, "sm_90", 132).group_rows
    assert not T.choose(lay(8192, 8192), 1, 8192, "interp", 4).group_rows
    # fit: one group per tile (g32 int4 = 4 words), cleared for per-element groups, refused elsewhere
    rows = T.GemvConfig("fma", 256, 16, 2, group_rows=True)
    assert T.fit(rows, lay(4096, 4096, G=32), 1).block_kw == 4
    assert T.fit(rows, lay(4096, 4096, G=64), 1).block_kw == 8
    assert T.fit(replace(rows, block_n=100), lay(4096, 4096), 1).block_n == 128
    assert T.fit(rows, lay(4096, 4096, G=100), 1) == replace(rows, block_n=128, group_rows=False)
    assert T.fit(replace(rows, group_rows=False, block_n=512), lay(4096, 4096), 1).block_n == 128
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='dot', prefetch=1, group_rows=True\): group_rows is an option "
                                         r"of the CUDA-core kernel \(kind='fma'\) with prefetch=1; use group_rows=False"):
        T.fit(replace(rows, kind="dot"), lay(4096, 4096), 16)
    with pytest.raises(ValueError, match=r"prefetch=2, group_rows=True"):
        T.fit(replace(rows, prefetch=2), lay(4096, 4096), 1)
    # autotuning offers both tile families at M=1 (the table's choice first), only plain ones otherwise
    cands = GT.candidates(lay(8192, 8192), 1, 8192, "sm_80", 108)
    assert cands[0].group_rows and {c.group_rows for c in cands} == {False, True}
    assert not any(c.group_rows for c in GT.candidates(lay(8192, 8192, M=16), 16, 8192, "sm_90", 132))
    assert not any(c.group_rows for c in GT.candidates(lay(8192, 8192, packing="gptq", act=True), 1, 8192, "sm_90", 132))


def test_tables_use_pdl_for_the_cuda_core_kernel_on_sm90_and_later_only():
    """The GPU tables launch the CUDA-core and fragment-layout ("frag") kernels with pdl from sm_90 on
    (measured faster on the H200), never the Triton tensor-core kernel (measured slower) nor sm_80 or the
    interpreter (it cannot run there); autotuning candidates keep the table's setting."""
    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv import aot as QA, autotune as GT
    from portakern.ir import DType, Packing, QuantFormat
    from portakern.ir.ops import QuantGemv

    fmt = QuantFormat(bits=4, group_size=128, symmetric=False, packing=Packing("native"))
    for M in (1, 16):
        lay = QA.LayoutStub(QuantGemv(M=M, N=4096, K=4096, dtype=DType.bfloat16, fmt=fmt))
        for arch in ("sm_80", "sm_90", "sm_100", "sm_120", "interp"):
            cfg = T.choose(lay, M, 4096, arch, 132)
            assert cfg.pdl == (cfg.kind in ("fma", "frag") and arch in ("sm_90", "sm_100", "sm_120")), (arch, cfg)
        cands = GT.candidates(lay, M, 4096, "sm_90", 132)
        assert cands[0] == T.choose(lay, M, 4096, "sm_90", 132)
        assert all(c.pdl == cands[0].pdl and c.prefetch == 1 for c in cands if c.kind != "stream")
        assert all(c.pdl for c in cands if c.kind == "stream") and (M == 1) == any(c.kind == "stream" for c in cands)


def test_tables_use_the_group_scaled_tensor_core_kernel_where_it_applies_and_fit_guards_it():
    """kind "mma" serves int4 M > 1 with whole-word regular groups of a multiple of 64, no act-order,
    fp16 / bf16 x; everything else stays on "dot" (or "fma"). ``fit`` keeps its K tile inside one
    group (8 to 32 word rows), its columns within 16..128, and refuses it for a weight it cannot serve."""
    from dataclasses import replace

    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv import aot as QA, autotune as GT
    from portakern.ir import DType, Packing, QuantFormat
    from portakern.ir.ops import QuantGemv

    def lay(M=16, bits=4, G=128, packing="native", act=False, sym=False, N=8192, K=8192, frag=False):
        """The layout facts of a prepared weight; ``frag=False``: one without the fragment layout (whose
        bf16 M > 1 calls take kind "frag" instead, tests/test_gemv_frag_layout.py)."""
        fmt = QuantFormat(bits=bits, group_size=G, symmetric=sym, packing=Packing(packing), has_g_idx=act)
        stub = QA.LayoutStub(QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=fmt))
        if not frag:
            stub.frag = None
        return stub

    assert T.choose(lay(frag=True), 16, 8192, "sm_90", 132, dtype="bfloat16").kind == "frag"
    assert T.choose(lay(frag=True), 16, 8192, "sm_90", 132, dtype="float16").kind == "mma"
    assert lay(G=64, frag=True).frag is None and lay(packing="gptq", act=True, frag=True).frag is None
    for arch in ("sm_80", "sm_90", "sm_100", "interp"):
        for dt in ("bfloat16", "float16"):
            for M in (3, 4, 16):   # the interpreter's table keeps M <= 2 on the CUDA-core kernel
                assert T.choose(lay(M), M, 8192, arch, 132, dtype=dt).kind == "mma", (arch, dt, M)
        assert T.choose(lay(), 16, 8192, arch, 132, dtype="float32").kind == "dot"
        assert T.choose(lay(G=64, sym=True), 16, 8192, arch, 132).kind == "mma"
        assert T.choose(lay(packing="awq"), 16, 8192, arch, 132).kind == "mma"
        for other in (lay(bits=8), lay(G=32), lay(packing="gptq", act=True)):
            assert T.choose(other, 16, 8192, arch, 132).kind == "dot", other.__dict__
        assert T.choose(lay(G=100), 16, 8192, arch, 132).kind == "fma"   # per-element groups
    assert T.choose(lay(1), 1, 8192, "sm_90", 132).kind == "stream"   # M=1 int4 from STREAM_MIN_N
    assert T.choose(lay(1), 1, 8192, "sm_80", 108).kind == "fma"
    cfg = T.choose(lay(), 16, 8192, "sm_90", 132)   # 128 column tiles, 4 slices: 3.9 programs per SM
    assert (cfg.block_n, cfg.block_kw, cfg.num_warps, cfg.num_stages, cfg.split_k, cfg.x_runs, cfg.pdl) == \
        (64, 16, 4, 3, 4, True, False)
    big = T.choose(lay(N=28672), 16, 28672, "sm_90", 132)   # from MMA_TILE_X_MIN_NK: x as one tile per group, no pipelining; 2 slices
    assert (big.block_n, big.num_stages, big.split_k, big.x_runs) == (64, 1, 2, False)
    wide = T.choose(lay(N=16384, K=16384), 16, 16384, "sm_90", 132)   # from MMA_WIDE_MIN_NK: 128 columns, 4 slices
    assert (wide.block_n, wide.num_stages, wide.split_k, wide.x_runs) == (128, 1, 4, False)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='dot', x_runs=True\): x_runs is an option of the 'mma' "
                                         r"kernel; use kind='mma' or x_runs=False"):
        T.fit(T.GemvConfig("dot", 64, 32, x_runs=True), lay(), 16)
    mma = T.GemvConfig("mma", 512, 64)
    assert (T.fit(mma, lay(), 16).block_kw, T.fit(mma, lay(), 16).block_n) == (16, 128)
    assert T.fit(mma, lay(G=64), 16).block_kw == 8
    assert T.fit(replace(mma, x_runs=True), lay(), 16).x_runs and not T.fit(replace(mma, x_runs=True), lay(G=64), 16).x_runs
    assert T.fit(mma, lay(G=1024), 16).block_kw == 32
    assert T.fit(replace(mma, block_n=8), lay(), 16) == replace(mma, block_n=16, block_kw=16)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='mma', swap_ab=True\): swap_ab is an option of the tensor-core"):
        T.fit(replace(mma, swap_ab=True), lay(), 16)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='mma'\) cannot serve this weight: bits=8 .*; use kind='dot'"):
        T.fit(mma, lay(bits=8), 16)
    with pytest.raises(ValueError, match=r"group_size=32 \(needs whole-word regular groups, a multiple of 64\)"):
        T.fit(mma, lay(G=32), 16)
    with pytest.raises(ValueError, match=r"act-order permutation"):
        T.fit(mma, lay(G=64, packing="gptq", act=True), 16)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='tc'\): the kinds are fma, dot, mma"):
        T.fit(replace(mma, kind="tc"), lay(), 16)
    cands = GT.candidates(lay(), 16, 8192, "sm_90", 132)
    assert cands[0] == cfg and {c.kind for c in cands} == {"mma"} and len(cands) > 12
