"""The Gluon prefill kernel for sm_90 (``AttnConfig.wgmma``, ``kernels/attention_wgmma.py``).

Gluon kernels have no interpreter, so off the GPU these tests check which ops the kernel serves
(``attention_wgmma.blocker``, the sm_90 table, ``check_wgmma``, ``fit``, autotuning candidates) and
its sm_90a lowering (TMA, setmaxnreg, 12 warps, the wgmma wait that keeps one group in flight); on an
sm_90 GPU it runs against the float64 cpu kernel with poisoned outputs, and a call whose q has no
(B, S, H * D) view falls back to attn_fwd with a warning.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from portakern.devices import CPU  # noqa: E402
from portakern.ir import DType, KVLayout  # noqa: E402
from portakern.ir import expr as E  # noqa: E402
from triton_helpers import (ATOL, LSE_ATOL, make_op, needs_compiler, run_reference, sm90_device,  # noqa: E402
                            tensors)

PREFILL = dict(B=2, Sq=4096, Sk=4096, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)


@pytest.mark.parametrize("arch,op_kw,match", [
    ("sm_80", {}, r"needs sm_90 \(wgmma\), not sm_80"),
    ("sm_100", {}, r"not sm_100"),
    ("sm_90", dict(kv_layout=KVLayout.PAGED, Sq=1, Sk=256, page_size=16, num_pages=40, has_seqlens_k=True),
     r"dense K/V without seqlens_k"),
    ("sm_90", dict(has_seqlens_k=True), r"without seqlens_k"),
    ("sm_90", dict(dtype=DType.float32), r"bf16/fp16 only, not float32"),
    ("sm_90", dict(D=96), r"head_dim == head_dim_v in \(64, 128, 256\)"),
    ("sm_90", dict(D=192), r"head_dim == head_dim_v"),
    ("sm_90", dict(Dv=64), r"head_dim == head_dim_v"),
    ("sm_90", dict(score_mod=E.softcap_score(30.0)), r"no score_mod and a positive scale"),
    ("sm_90", dict(scale=-0.1), r"positive scale"),
    ("sm_90", dict(mask_mod=E.window_mask(128, 0)), r"no mask or the causal mask only"),
    ("sm_90", dict(mask_mod=E.causal_mask(), Sq=4096, Sk=1024), r"causal with seqlen_k >= seqlen_q"),
], ids=["sm80", "sm100", "paged", "seqlens-k", "fp32", "d96", "d192", "dv64", "score-mod", "negative-scale",
        "window", "causal-short-keys"])
def test_blocker_names_what_the_kernel_does_not_serve(arch, op_kw, match):
    from portakern.backends.triton.attention import wgmma as W

    op = make_op(**{**PREFILL, **op_kw})
    why = W.blocker(op, arch)
    assert why is not None and __import__("re").search(match, why), why


def test_sm90_table_runs_d128_and_d256_prefill_and_d64_only_without_a_mask_from_4k_keys():
    """``WGMMA_TABLE``: D=128 (128-key tiles, 2 stages) and D=256 (64-key tiles, 2 stages) at every prefill
    shape from 128 query rows, causal or not; D=64 (128-key tiles, 2 stages) only unmasked with >= 4096
    keys; never with other masks, on other families, for decode or under ``wgmma=False``; autotuning times
    the kernel's tiles, each passing ``check_wgmma``."""
    from portakern.backends.triton.attention import autotune as AT, config as C, plan, rules as R

    def cfg(arch="sm_90", **kw):
        return plan.choose(make_op(**{**PREFILL, **kw}), arch, 132)

    for kw in ({}, dict(mask_mod=E.causal_mask()), dict(Sq=1000, Sk=1000), dict(Sq=128, Sk=128, B=1),
               dict(dtype=DType.float16, return_lse=True)):
        c = cfg(**kw)
        assert c.wgmma and (c.block_m, c.block_n, c.num_warps, c.num_stages) == (128, 128, 4, 2), (kw, c)
        assert not (c.tma or c.pack > 1 or c.num_splits > 1)
        c = cfg(**{**kw, "D": 256})
        assert c.wgmma and (c.block_m, c.block_n, c.num_warps, c.num_stages, c.k_stages) == (128, 64, 4, 2, 0), (kw, c)
    d256_window = cfg(D=256, mask_mod=E.window_mask(8, 0))
    assert not d256_window.wgmma and d256_window.tma          # attn_fwd's TMA tile serves windows at D > 128
    c = cfg(D=64, Sk=4096)
    assert c.wgmma and (c.block_n, c.num_stages) == (128, 2)
    for kw in (dict(D=64, mask_mod=E.causal_mask()), dict(D=64, Sq=1024, Sk=1024), dict(Sq=64, Sk=4096),
               dict(Sq=1, Sk=32768)):
        assert not cfg(**kw).wgmma, kw
    for arch in ("sm_80", "sm_100", "sm_120", "interp"):
        assert not cfg(arch).wgmma, arch
    op = make_op(**PREFILL)
    assert not plan.choose(op, "sm_90", 132, wgmma=False).wgmma
    cands = AT.candidates(op, "sm_90", 132)
    assert cands[0] == plan.choose(op, "sm_90", 132)
    wg = [c for c in cands if c.wgmma]
    assert {(c.block_n, c.num_stages) for c in wg} == {(128, 3), (64, 3), (128, 2), (64, 4)}
    assert any(not c.wgmma for c in cands) and not any(c.wgmma and c.lazy_rescale for c in cands)
    for c in wg:
        R.check_wgmma(op, c, "sm_90")
    assert not any(c.wgmma for c in AT.candidates(make_op(**PREFILL, mask_mod=E.window_mask(8, 0)), "sm_90", 132))
    assert C.AttnConfig(**wg[0].to_json()) == wg[0]


@pytest.mark.parametrize("arch,op_kw,cfg_kw,match", [
    ("sm_80", {}, {}, r"does not serve this op \(needs sm_90 \(wgmma\), not sm_80\); use wgmma=False"),
    ("sm_90", dict(D=96), {}, r"does not serve this op \(head_dim == head_dim_v in \(64, 128, 256\) only\); use wgmma"),
    ("sm_90", {}, dict(num_stages=1), r"needs num_stages >= 2 and block_n 32, 64 or 128, not 1 / 64"),
    ("sm_90", {}, dict(block_n=16), r"needs num_stages >= 2 and block_n 32, 64 or 128, not 3 / 16"),
    ("sm_90", dict(D=256), dict(num_stages=3), r"with block_n=64, num_stages=3 and k_stages=0 needs 263168 bytes "
                                                r"of shared memory, over sm_90's 232448"),
    ("sm_90", dict(D=256), dict(num_stages=2, k_stages=4), r"with block_n=64, num_stages=2 and k_stages=4 needs "
                                                          r"263168 bytes of shared memory, over sm_90's 232448"),
    ("sm_90", {}, dict(k_stages=1), r"needs k_stages 0 \(num_stages\) or >= 2, not 1"),
    ("sm_90", {}, dict(num_warps=8), r"runs block_m=128 with num_warps=4, not 128 / 8"),
    ("sm_90", {}, dict(tma=True), r"has its own TMA loads and schedule"),
    ("sm_90", {}, dict(num_splits=4), r"has its own TMA loads and schedule: .*num_splits stay off"),
], ids=["sm80", "d96", "one-stage", "bn16", "d256-smem", "d256-k-ring-smem", "k-ring-1", "8-warps", "tma", "splits"])
def test_check_wgmma_refuses_with_the_reason_and_the_way_out(arch, op_kw, cfg_kw, match):
    from dataclasses import replace

    from portakern.backends.triton.attention import config as C, rules as R

    op = make_op(**{**PREFILL, **op_kw})
    cfg = replace(C.AttnConfig(128, 64, 4, 3, wgmma=True), **cfg_kw)
    with pytest.raises(ValueError, match=r"AttnConfig\(wgmma=True\): the Gluon prefill kernel " + match):
        R.check_wgmma(op, cfg, arch)


def test_fit_keeps_the_kernel_where_it_serves_and_falls_back_to_the_attn_fwd_table_elsewhere():
    from dataclasses import replace

    from portakern.backends.triton.attention import config as C, forward as F, plan, rules as R

    op = make_op(**PREFILL)
    got = plan.fit(op, C.AttnConfig(64, 128, 8, 1, wgmma=True, tma=True), "sm_90")
    assert got == C.AttnConfig(128, 128, 4, 2, wgmma=True)
    assert plan.fit(op, C.AttnConfig(128, 128, 4, 4, wgmma=True), "sm_90") == \
        C.AttnConfig(128, 128, 4, 3, wgmma=True)                       # the table's 224 KiB ring fits
    d256 = make_op(**{**PREFILL, "D": 256})   # 4 stages of 128 keys: too large; stages down to 2, then tiles
    assert plan.fit(d256, C.AttnConfig(128, 128, 4, 4, wgmma=True), "sm_90") == \
        C.AttnConfig(128, 64, 4, 2, wgmma=True)
    # a deeper K ring: kept where it fits (3 K + 2 V tiles of 64 keys beside D=256's 64 KiB query tile),
    # shortened where it does not, dropped when no deeper than the V ring
    k3 = C.AttnConfig(128, 64, 4, 2, wgmma=True, k_stages=3)
    assert plan.fit(d256, k3, "sm_90") == k3
    assert plan.fit(d256, replace(k3, k_stages=5), "sm_90") == k3
    assert plan.fit(d256, replace(k3, k_stages=2), "sm_90") == replace(k3, k_stages=0)
    assert plan.fit(d256, replace(k3, block_n=128, num_stages=3), "sm_90") == replace(k3, k_stages=0)
    with pytest.raises(ValueError, match=r"AttnConfig\(k_stages=3\) without wgmma: a separate K ring depth is the "
                                         r"Gluon prefill kernel's; use k_stages=0 or wgmma=True"):
        R.check_wgmma(op, C.AttnConfig(128, 64, 8, 2, k_stages=3), "sm_90")
    for other, arch in ((make_op(**{**PREFILL, "D": 96}), "sm_90"), (op, "sm_80")):
        assert plan.fit(other, C.AttnConfig(128, 64, 4, 3, wgmma=True), arch) == \
            plan.choose(other, arch, wgmma=False)
    with pytest.raises(ValueError, match=r"wgmma=True\): the Gluon prefill kernel does not serve this op \(needs sm_90 "
                                         r"\(wgmma\), not interp\)"):
        F.build(make_op(B=1, Sq=16, Sk=16, Hq=2, Hkv=2, D=64), CPU, C.AttnConfig(128, 64, 4, 3, wgmma=True))


def test_call_blocker_names_tensors_the_descriptors_cannot_take():
    """Per-call reasons for the attn_fwd fallback: heads not adjacent, and TMA's alignment rules."""
    from portakern.backends.triton.attention.wgmma import call_blocker

    a = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    assert call_blocker(a, a, a) is None
    wide = torch.empty(2, 300, 4, 136, dtype=torch.bfloat16)[..., :128]
    assert call_blocker(wide, a, a) == ("q with strides (163200, 544, 136, 1) has no (B, S, H * D) view "
                                        "(heads adjacent, last stride 1)")
    shifted = torch.empty(a.numel() + 1, dtype=torch.bfloat16)[1:].view(2, 300, 4, 128)   # 2 bytes in
    assert call_blocker(a, a, shifted).startswith("v starts at address") and "not 16-byte aligned" in \
        call_blocker(a, a, shifted)


@needs_compiler
@pytest.mark.parametrize("D,causal,lse", [(128, True, True), (64, False, False)], ids=["d128-causal-lse", "d64"])
def test_lowering_for_sm90a_has_tma_a_load_warp_and_scores_one_tile_ahead(D, causal, lse):
    """The table's choice lowers to the Gluon kernel: 12 warps (4 + 4 + a load warp padded to a
    warpgroup), setmaxnreg, TMA loads with mbarrier waits, and a ``wgmma.wait_group 1`` (the scores of
    tile t waited on while tile t-1's P V stays in flight)."""
    from portakern.backends.triton import attention as A

    op = make_op(**{**PREFILL, "D": D, "return_lse": lse}, mask_mod=E.causal_mask() if causal else None)
    art = A.compile_for_target(op, "sm_90a")
    assert art["config"]["wgmma"] and list(art["kernels"]) == ["attn_fwd_wgmma"]
    k = art["kernels"]["attn_fwd_wgmma"]
    ptx = k["ptx"]
    assert k["num_warps"] == 12 and ".reqntid 384" in ptx
    assert ptx.count("setmaxnreg") >= 4 and "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx and ptx.count("wgmma.mma_async") >= 32
    assert k["shared"] <= 227 * 1024 and k["cubin"]
    assert "attn_fwd" in A.compile_for_target(op, "sm_80")["kernels"]   # other targets: the Triton kernel


# -- on an sm_90 GPU ------------------------------------------------------------------------------------

def _gpu():
    return sm90_device("the wgmma kernel")


@needs_compiler
@pytest.mark.parametrize("case", [
    dict(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=128, causal=True, dtype=DType.bfloat16, cfg=(128, 3)),
    dict(B=2, Sq=300, Sk=300, Hq=4, Hkv=2, D=128, causal=False, dtype=DType.float16, cfg=(128, 2)),
    dict(B=1, Sq=200, Sk=700, Hq=8, Hkv=1, D=128, causal=True, dtype=DType.bfloat16, cfg=(64, 4)),
    dict(B=2, Sq=257, Sk=513, Hq=4, Hkv=4, D=64, causal=False, dtype=DType.bfloat16, cfg=(128, 2)),
    dict(B=1, Sq=128, Sk=128, Hq=2, Hkv=2, D=64, causal=True, dtype=DType.float16, cfg=(64, 3)),
], ids=["d128-causal-gqa", "d128-fp16", "d128-causal-more-keys", "d64-tails", "d64-one-tile"])
def test_gpu_matches_the_float64_reference(case):
    """Partial tiles at both ends, GQA / MQA, bottom-right causal with more keys than queries, the
    batch boundary inside a tile (the 3-D descriptors zero-fill it), LSE; outputs poisoned first."""
    from portakern.backends.triton.attention import config as C, forward as F

    dev = _gpu()
    case = dict(case)
    bn, st = case.pop("cfg")
    causal = case.pop("causal")
    op = make_op(**case, mask_mod=E.causal_mask() if causal else None, return_lse=True)
    cuda = torch.device(str(dev))
    q, k, v = tensors(op, seed=5)
    ref_out, ref_lse = run_reference(op, q, k, v)
    q, k, v = (t.to(cuda) for t in (q, k, v))
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=q.dtype, device=cuda)
    lse = torch.full(s["lse"], float("nan"), device=cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback: this must run the Gluon kernel
        F.build(op, dev, C.AttnConfig(128, bn, 4, st, wgmma=True))(q, k, v, out, lse, {})
    torch.cuda.synchronize()
    err = np.abs(out.double().cpu().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g}"
    assert np.abs(lse.double().cpu().numpy() - ref_lse).max() <= LSE_ATOL


@needs_compiler
def test_gpu_falls_back_to_attn_fwd_for_a_q_without_a_flat_head_view():
    from portakern.backends.triton.attention import forward as F, plan

    dev = _gpu()
    op = make_op(B=1, Sq=256, Sk=256, Hq=4, Hkv=2, D=128, dtype=DType.bfloat16, return_lse=False)
    cuda = torch.device(str(dev))
    q, k, v = tensors(op, seed=6)
    ref_out, _ = run_reference(op, q, k, v)
    wide = torch.zeros(1, 256, 4, 136, dtype=torch.bfloat16, device=cuda)
    wide[..., :128] = q.to(cuda)
    qv = wide[..., :128]                     # heads 136 elements apart: no (B, S, H * D) view
    out = torch.full(op.shapes()["out"], float("nan"), dtype=torch.bfloat16, device=cuda)
    kern = F.build(op, dev, plan.choose(op, *plan.family(dev)))
    assert kern.config.wgmma
    with pytest.warns(RuntimeWarning, match=r"runs attn_fwd instead of the wgmma prefill kernel for this call: "
                                            r"q with strides \(139264, 544, 136, 1\) has no \(B, S, H \* D\) view"):
        kern(qv, k.to(cuda), v.to(cuda), out, None, {})
    torch.cuda.synchronize()
    assert np.abs(out.double().cpu().numpy() - ref_out).max() <= ATOL[op.dtype]
