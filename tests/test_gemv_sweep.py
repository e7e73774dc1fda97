"""The GEMV sweep's candidates for the fragment-layout kernel (``benchmarks/gemv_sweep.py``) and the main table's record
of a launch configuration (``benchmarks/gemv_problems.py``): pure configuration logic, CPU."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from gemv_problems import gemv_op  # noqa: E402
from gemv_sweep import frag_candidates, split_for_shape  # noqa: E402

from portakern.backends.triton.quant_gemv import config as T  # noqa: E402
from portakern.backends.triton import tuning  # noqa: E402
from portakern.backends.triton.quant_gemv import aot as QA  # noqa: E402
from portakern.ir import gemv_layout  # noqa: E402


@pytest.mark.parametrize("M, N, K", [(4, 4096, 4096), (4, 14336, 4096), (16, 4096, 14336), (16, 28672, 8192),
                                     (16, 16384, 16384)])
def test_frag_candidates_hold_the_table_choice_with_and_without_pdl(M, N, K):
    op = gemv_op(M, N, K)
    cands = frag_candidates(op, (False, True))
    table = T.choose(QA.LayoutStub(op), M, N, "sm_90", 132, dtype="bfloat16")
    assert table.kind == "frag"
    for pdl in (False, True):
        assert replace(table, pdl=pdl) in cands, (table, cands)
    # every candidate is already what fit makes of it (the sweep launches exactly what it records)
    for c in cands:
        assert T.fit(c, QA.LayoutStub(op), M) == c
        assert 1 <= c.split_k <= tuning.FRAG_MAX_SPLIT
    assert len(cands) == len(set(cands)) and {c.pdl for c in cands} == {False, True}


def test_frag_candidates_only_where_the_kernel_serves():
    assert frag_candidates(gemv_op(1, 4096, 4096), (False, True)) == []      # M = 1: CUDA-core kernels
    assert frag_candidates(gemv_op(32, 4096, 4096)) == []                    # the kernel holds 16 rows of x
    assert frag_candidates(gemv_op(4, 4096, 4096, bits=8)) == []             # int8: no fragment layout
    assert frag_candidates(gemv_op(4, 4096, 4096, gs=64)) == []              # groups below a 128-column chunk
    assert all(not c.pdl for c in frag_candidates(gemv_op(4, 4096, 4096)))  # pdl only when asked


def test_a_winner_moved_to_another_shape_takes_that_shape_s_split():
    c = T.GemvConfig("frag", 64, 32, 2, split_k=3)
    assert split_for_shape(c, 16, 4096, 14336, 4).split_k == T.frag_split(4096, 14336, c, 16, 132)
    f = T.GemvConfig("fma", 32, 64, 4, split_k=7)
    kwp = -(-(14336 // 8) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    assert split_for_shape(f, 1, 4096, 14336, 4).split_k == T.split_k_for(4096, kwp, f, 132)


def test_the_main_table_records_either_backends_launch_configuration():
    # pk_config of a row: the cuda kernel's SmallMConfig, or the triton kernel's chosen GemvConfig
    from types import SimpleNamespace

    from gemv_problems import config_json

    from portakern.backends.cuda.quant_gemv import SmallMConfig

    cuda_kernel = SimpleNamespace(config=SmallMConfig(32, 4, 8, 2, 1))
    assert config_json(cuda_kernel) == {"quads": 32, "lanes": 4, "splits": 8, "pf": 2, "ldna": 1}
    cfg = T.choose(QA.LayoutStub(gemv_op(1, 4096, 4096)), 1, 4096, "sm_90", 132, dtype="bfloat16")
    triton_kernel = SimpleNamespace(launchers={(1,): SimpleNamespace(cfg=cfg)})
    assert config_json(triton_kernel) == cfg.to_json()
