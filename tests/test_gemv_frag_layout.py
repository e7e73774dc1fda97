"""Where the tensor-core GEMV kernel "frag" (``kernels/gemv_frag.py``) serves in the triton backend's tuning table,
on the CPU: the bf16 M = 2..16 entries, the split each shape takes, and the fallback to the other kernels when a
weight has no fragment copy or this Triton lacks Gluon's MMA. The fragment layout itself (packing, unpacking, an
``mma.m16n8k16`` emulation) is tested in ``tests/test_gemv_layout.py``; the kernel runs in the GPU tests
(``test_triton_gemv.py -k gpu``) and is lowered for sm_80 / sm_90a / sm_100a in the compile cases.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from portakern.backends.triton.quant_gemv import config as T  # noqa: E402
from portakern import gemv_weight  # noqa: E402
from portakern.backends.triton import tuning  # noqa: E402
from portakern.backends.triton.quant_gemv import aot as QA  # noqa: E402


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
    assert cfg.pdl      # with PDL best or within noise on 10 of 12 shapes (results/gemv-pdl-sweep-h200.json)
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
    # the H200 sweep winners (benchmarks/results/gemv-frag-sweep-h200.json)
    (4096, 4096, 16, 8), (14336, 4096, 16, 4), (28672, 4096, 16, 2), (4096, 14336, 16, 8),
    (4096, 4096, 4, 16), (14336, 4096, 4, 8), (128256, 4096, 16, 1),
])
def test_frag_split_follows_the_sweep(N, K, M, split):
    cfg = T.choose(_layout(N, K), M, N, "sm_90", 132, dtype="bfloat16")
    assert cfg.split_k == split
    assert cfg.block_n == (256 if N >= tuning.FRAG_WIDE_MIN_N else 64)


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


def test_without_gluon_no_weight_gets_the_layout_and_the_table_keeps_mma(monkeypatch):
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=16, N=4096, K=4096, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    from portakern.devices import Device

    gpu = Device("cuda", 0, "GPU 0")
    assert QA.frag_kernel_available() and QA.LayoutStub(op).frag is not None   # Triton >= 3.5 here
    assert gemv_weight.wants_fragments(gpu)
    # a Triton without Gluon's Ampere MMA: its import fails, and the probe (cached per process) is asked again
    gemv_weight.fragment_kernel_available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon.language.nvidia.ampere", None)
    try:
        assert not gemv_weight.wants_fragments(gpu)     # what every backend of the layout prepares
        stub = QA.LayoutStub(op)
        assert stub.frag is None
        assert T.choose(stub, 16, 4096, "sm_90", 132, dtype="bfloat16").kind == "mma"
    finally:
        monkeypatch.undo()
        gemv_weight.fragment_kernel_available.cache_clear()
    assert gemv_weight.wants_fragments(gpu)
