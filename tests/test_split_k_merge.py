"""The two split-K merges (``MERGE``) of the CUDA-core and "frag" GEMV kernels: what each lowers to for sm_90a (no
GPU), and that the interpreter never polls. Both merges sum the partials in slice order, so their values are equal
bit for bit (``tests/test_gemv_frag_modes.py`` lowers the "frag" kernel's two merges too)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from portakern.backends.triton import quant_gemv as Q  # noqa: E402
from portakern.backends.triton import tuning  # noqa: E402
from portakern.backends.triton.quant_gemv import aot as QA, config as T, launcher as QL  # noqa: E402
from portakern.ir import DType, QuantFormat  # noqa: E402
from portakern.ir.ops import QuantGemv  # noqa: E402

COUNT_READ_BACK = r"atom\.global\.(gpu\.acq_rel|acq_rel\.gpu)\.add"
COUNT_RELEASED = r"(atom|red)\.global\.(gpu\.release|release\.gpu)\.add"
COUNT_POLLED = r"(atom\.global\.(gpu\.acquire|acquire\.gpu)\.add|ld\.global\.(gpu\.acquire|acquire\.gpu))"


def _op(M=1, N=4096, K=14336, bits=4):
    return QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=bits, group_size=128, symmetric=False))


def _ptx(op, merge, monkeypatch, kind):
    monkeypatch.setitem(tuning.SPLIT_MERGE, kind, merge)
    out = Q.compile_for_target(op, "sm_90a")
    (k,) = out["kernels"].values()
    return out["config"], k["ptx"]


@pytest.mark.parametrize("bits, N, K", [(4, 4096, 14336), (4, 4096, 4096), (8, 8192, 8192)])
def test_cuda_core_kernel_merges(bits, N, K, monkeypatch):
    op = _op(1, N, K, bits)
    cfg0, zero = _ptx(op, 0, monkeypatch, "fma")
    cfg1, one = _ptx(op, 1, monkeypatch, "fma")
    assert cfg0 == cfg1 and cfg0["kind"] == "fma" and cfg0["split_k"] > 1, cfg0
    # MERGE 0: one acquire-release count, read back by every slice; no polling
    assert len(re.findall(COUNT_READ_BACK, zero)) == 1 and not re.search(COUNT_POLLED, zero)
    # MERGE 1: the publishers' release count, never read back; the last slice's polls (before and in the loop)
    assert not re.search(COUNT_READ_BACK, one) and re.search(COUNT_RELEASED, one)
    assert len(re.findall(COUNT_POLLED, one)) >= 2
    # the count back to zero by subtraction (a timed-out poll's late arrivals cancel out), never an exchange
    assert len(re.findall(COUNT_RELEASED, one)) >= 2 and "exch" not in one
    # the main loop is the same: as many 16-byte loads and FMAs
    for pat in (r"ld\.global(\.nc)?\.v4", r"\bfma\.rn\.f32"):
        assert len(re.findall(pat, zero)) == len(re.findall(pat, one)), pat


def test_frag_kernel_merge_follows_its_table_switch(monkeypatch):
    op = _op(4, 4096, 4096)
    cfg, zero = _ptx(op, 0, monkeypatch, "frag")
    _, one = _ptx(op, 1, monkeypatch, "frag")
    assert cfg["kind"] == "frag" and cfg["split_k"] > 1
    assert re.search(COUNT_READ_BACK, zero) and not re.search(COUNT_POLLED, zero)
    assert not re.search(COUNT_READ_BACK, one) and len(re.findall(COUNT_POLLED, one)) >= 2


def test_frag_merge_is_the_switch_up_to_its_size_limit(monkeypatch):
    """Above ``SPLIT_MERGE_MAX_NK`` the "frag" kernel keeps the last-to-arrive merge whatever the switch says (the
    grid's-last-slice merge lost 18 us at M=16 28672x8192 on an H100)."""
    monkeypatch.setitem(tuning.SPLIT_MERGE, "frag", 1)
    small, large = _op(16, 4096, 14336), _op(16, 28672, 8192)
    for op, want in ((small, 1), (large, 0)):
        lay = QA.LayoutStub(op)
        cfg = T.choose(lay, op.M, op.N, "sm_90", 132)
        assert cfg.kind == "frag", cfg
        assert QL.constexprs(op, lay, cfg)["MERGE"] == want, (op.N, op.K)
    monkeypatch.setitem(tuning.SPLIT_MERGE, "frag", 0)
    monkeypatch.setitem(tuning.SPLIT_MERGE, "fma", 1)
    assert T.split_merge("frag", 4096, 4096) == 0 and T.split_merge("frag", 28672, 8192) == 0
    assert T.split_merge("fma", 8192, 8192) == 1 and T.split_merge("fma", 28672, 8192) == 0


def test_the_interpreter_never_polls(monkeypatch):
    """The interpreter runs one program at a time: a slice polling for later ones could not finish, so its
    launches take MERGE 0 whatever the table says."""
    monkeypatch.setitem(tuning.SPLIT_MERGE, "fma", 1)
    op = _op(1, 4096, 4096)
    lay = QA.LayoutStub(op)
    cfg = T.choose(lay, 1, 4096, "sm_90", 132)
    assert QL.constexprs(op, lay, cfg, interpret=True)["MERGE"] == 0
    assert QL.constexprs(op, lay, cfg, interpret=False)["MERGE"] == 1
