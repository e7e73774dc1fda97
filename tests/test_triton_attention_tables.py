"""Configuration tables of the triton attention backend (``backends/triton/tuning.py``): what
``attention/plan.choose`` and ``attention/autotune.candidates`` pick per architecture, without compiling or running a kernel.
The figures each rule rests on are in ``tuning.py`` beside it."""

from __future__ import annotations

import pytest

from portakern.ir import DType, KVLayout
from portakern.ir import expr as E
from triton_helpers import make_op


def test_split_count_is_not_rounded_to_equal_shares():
    """The kernel shares key tiles out floor / ceil, so the split count is what fills the SMs (bounded
    by two tiles per split), not rounded down to equal shares: B=1 decode over 17 tiles of 64 keys
    takes 8 splits (64 programs), where equal shares of 3 tiles gave 6."""
    from portakern.backends.triton import tuning
    from portakern.backends.triton.attention import plan

    op = make_op(B=1, Sq=1, Sk=17 * 64, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    cfg = plan.choose(op, "sm_90", 132)
    assert (cfg.block_n, cfg.pack, cfg.num_splits) == (64, 4, 17 // tuning.MIN_TILES_PER_SPLIT)
    long = make_op(B=1, Sq=1, Sk=8193, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    assert plan.choose(long, "sm_90", 132).num_splits == 16       # 132 SMs // 8 KV heads


def test_split_paged_decode_table():
    """The sm_90 table for paged decode's attn_fwd kernel (``tuning.SPLIT_PAGED_TILE``; the table runs split
    paged decode on the Gluon kernel, ``test_triton_attention_decode_ws.py``, and these rules serve
    ``wgmma=False`` and its fallback): split decode on 64-key tiles for every page size, at two programs per SM
    where two rings fit (3 stages) and with the fewest splits of the same longest split once the grid is full,
    launched with pdl and merged by ``attn_combine``; the step's 2049 keys keep 16 splits of two tiles; unsplit
    batches (B=64) take dense decode's 64-key, 4-stage tile; sm_100 keeps the earlier rule (128-key tiles for
    pages of 16 and for unsplit batches)."""
    from portakern.backends.triton.attention import plan

    def fwd(op):
        return plan.choose(op, "sm_90", 132, wgmma=False)

    def paged(B, pages):
        return make_op(B=B, Sq=1, Sk=pages * 64, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16,
                       kv_layout=KVLayout.PAGED, page_size=64, num_pages=B * pages + 1, has_seqlens_k=True)

    step = fwd(paged(1, 33))                             # the decode step's cache at 2049 keys
    assert (step.block_n, step.num_splits, step.pdl, step.fused_combine) == (64, 16, True, False)  # 2 tiles each
    long = fwd(paged(1, 512))                            # 32k keys: two programs per SM
    assert (long.block_n, long.num_stages, long.num_splits) == (64, 3, 32)
    assert plan.choose(paged(1, 512), "sm_100", 148).num_splits == 18
    # two programs only where both rings fit one SM (227 KiB): at 120 KiB a program, one per SM
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "smem_bytes", lambda *a: 120 * 1024)
        assert fwd(paged(1, 512)).num_splits == 16
    big = plan.choose(paged(64, 64), "sm_90", 132)        # unsplit: the dense tile (B=64 4k)
    assert not big.decode_ws and big == fwd(paged(64, 64))
    assert (big.block_n, big.num_stages, big.num_splits, big.pdl) == (64, 4, 1, False)
    assert plan.choose(paged(64, 64), "sm_100", 148).block_n == 128
    assert not plan.choose(paged(1, 33), "sm_80", 108).pdl
    p16 = make_op(B=1, Sq=1, Sk=32768, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16, kv_layout=KVLayout.PAGED,
                  page_size=16, num_pages=2049, has_seqlens_k=True)
    small = fwd(p16)
    # 2 x 132 programs over 8 KV heads: 33 splits wanted, 32 give each of the 512 key tiles' splits as
    # many (16); 64-key tiles, 3 stages (two programs' rings fit an SM)
    assert (small.block_n, small.num_stages, small.num_splits, small.fused_combine, small.pdl) == \
        (64, 3, 32, False, True)
    odd = make_op(B=1, Sq=1, Sk=8192 + 5 * 64, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16, kv_layout=KVLayout.PAGED,
                  page_size=16, num_pages=600, has_seqlens_k=True)
    assert fwd(odd).num_splits == 27                           # 133 tiles: 5 per split in 27 (or in 33)
    assert 2 * plan.smem_bytes(p16, small.block_m, small.block_n, small.num_stages) <= 228 * 1024
    sm100 = plan.choose(p16, "sm_100", 148)
    assert (sm100.block_n, sm100.num_splits, sm100.fused_combine) == (128, 18, False)


def test_autotune_candidates_include_lazy_rescale_and_pdl_only_where_the_table_has_it():
    """Autotuning (PORTAKERN_TRITON_AUTOTUNE=1) times lazy_rescale for prefill, so a device picks it
    only when faster there; pdl stays as the table's: on for split decode on sm_90 (measured and
    checked on the H200), off elsewhere."""
    from portakern.backends.triton.attention import autotune as AT, plan

    pre = make_op(B=2, Sq=2048, Sk=2048, Hq=16, Hkv=16, D=128, dtype=DType.bfloat16, mask_mod=E.causal_mask())
    cands = AT.candidates(pre, "sm_90", 132)
    assert cands[0] == plan.choose(pre, "sm_90", 132) and not cands[0].lazy_rescale
    assert sum(c.lazy_rescale for c in cands) == 2 and not any(c.pdl for c in cands)
    dec = make_op(B=1, Sq=1, Sk=32768, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    for arch, sms in (("sm_90", 132), ("sm_80", 108)):
        cands = AT.candidates(dec, arch, sms)
        assert len(cands) > 1 and not any(c.lazy_rescale for c in cands), arch
        assert all(c.pdl == (arch == "sm_90" and c.num_splits > 1) for c in cands), arch
