"""The triton attention backend under Triton's CPU interpreter, against the float64 references.

The tests that launch kernels are marked ``interpreter``: they need ``TRITON_INTERPRET=1`` before triton's first
import, which the interpreter step of scripts/test.sh sets (see ``triton_helpers``); the lowering tests need
Triton's compiler (``needs_compiler``). Reference: the cpu backend's kernel in float64. Outputs are NaN-poisoned
before each launch, so an element the kernel does not write fails. What every backend owes the API (values against
an independent float64 reference, fully masked rows, key lengths, strided inputs, array types) is the contract
suite's (tests/contract), which the interpreter step runs on this backend too.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triton_helpers import _cache_dir  # noqa: E402,F401  (the module's expression cache)
from triton_helpers import (ATOL, LSE_ATOL, TORCH_DTYPE, check, make_op, needs_compiler,  # noqa: E402
                            run_reference, tensors)

from portakern.devices import CPU  # noqa: E402
from portakern.ir import DType, KVLayout  # noqa: E402
from portakern.ir import expr as E  # noqa: E402


# -- dense prefill: dtypes x variants ----------------------------------------------------------------

CUSTOM_SCORE = E.score * 0.5 + E.where(E.q_idx > E.kv_idx, 0.25, -0.5) + E.h * 0.1
CUSTOM_MASK = E.where(E.h.eq(1), E.kv_idx >= 3, E.kv_idx < E.q_idx + 20) & (E.kv_idx.ne(7) | E.b.eq(1))

VARIANTS = {
    "plain": {},
    "causal": {"mask_mod": E.causal_mask()},
    "window": {"mask_mod": E.window_mask(9, 4)},
    "causal+window": {"mask_mod": E.causal_mask() & E.window_mask(17, -1)},
    "softcap": {"score_mod": E.softcap_score(2.0), "mask_mod": E.causal_mask()},
    "alibi": {"score_mod": E.alibi_score(E.alibi_slopes(4)), "mask_mod": E.causal_mask()},
    "custom": {"score_mod": CUSTOM_SCORE, "mask_mod": CUSTOM_MASK},
    "prefix_lm": {"mask_mod": E.prefix_lm_mask(13)},
    "document": {"mask_mod": E.document_mask((11, 40))},
}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [DType.float16, DType.bfloat16, DType.float32], ids=lambda d: d.value)
@pytest.mark.parametrize("variant", list(VARIANTS), ids=str)
def test_dense_variants(dtype, variant):
    op = make_op(B=2, Sq=45, Sk=61, Hq=4, Hkv=2, D=40, dtype=dtype, **VARIANTS[variant])
    check(op, *tensors(op))


@pytest.mark.interpreter
@pytest.mark.parametrize("D,Dv", [(32, 32), (59, 59), (96, 96), (111, 111), (128, 128), (256, 256), (64, 48)],
                         ids=lambda x: str(x))
def test_head_dims(D, Dv):
    op = make_op(B=1, Sq=20, Sk=35, Hq=2, Hkv=1, D=D, Dv=Dv, mask_mod=E.causal_mask())
    check(op, *tensors(op))


# -- decode: split-KV, GQA packing ------------------------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [DType.float16, DType.bfloat16], ids=lambda d: d.value)
@pytest.mark.parametrize("Sq,Hq,Hkv", [(1, 8, 2), (1, 6, 1), (4, 8, 2), (1, 2, 2)], ids=str)
def test_decode_split_kv(dtype, Sq, Hq, Hkv):
    op = make_op(B=2, Sq=Sq, Sk=300, Hq=Hq, Hkv=Hkv, D=64, dtype=dtype, mask_mod=E.causal_mask())
    _, _, kern = check(op, *tensors(op))
    assert kern.config.num_splits > 1 and kern.config.pack == Hq // Hkv
    tiles = -(-Sq // (kern.config.block_m // kern.config.pack)) * 2 * Hkv
    assert kern.workspace_bytes == 4 * kern.config.num_splits * 2 * Sq * Hq * (64 + 1) + 4 * tiles


@pytest.mark.interpreter
@pytest.mark.parametrize("Sk", [700, 150], ids=lambda s: f"sk{s}")
def test_decode_separate_combine_kernel(Sk):
    """Many splits merge in ``attn_combine`` instead of in the last split's program. The key tiles
    (16 keys under the interpreter) are shared out floor / ceil: 44 tiles give the 24 splits one or two
    each; 10 tiles leave 14 of them empty, interleaved with the busy ones."""
    from dataclasses import replace

    from portakern.backends.triton.attention import forward as F, plan

    op = make_op(B=1, Sq=2, Sk=Sk, Hq=4, Hkv=1, D=64, mask_mod=E.causal_mask())
    q, k, v = tensors(op)
    cfg = replace(plan.for_device(op, CPU), num_splits=24, fused_combine=False)
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=torch.float16)
    lse = torch.full(s["lse"], float("nan"))
    F.build(op, CPU, cfg)(q, k, v, out, lse, {})
    ref_out, ref_lse = run_reference(op, q, k, v)
    assert np.abs(out.double().numpy() - ref_out).max() < ATOL[op.dtype]
    assert np.abs(lse.double().numpy() - ref_lse).max() < LSE_ATOL


@pytest.mark.interpreter
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("Sq", [1, 5])
def test_paged(page, Sq):
    B, max_pages, Hq, Hkv, D = 3, 5, 4, 2, 32
    P = B * max_pages + 2
    op = make_op(B=B, Sq=Sq, Sk=max_pages * page, Hq=Hq, Hkv=Hkv, D=D, kv_layout=KVLayout.PAGED,
                 page_size=page, num_pages=P, has_seqlens_k=True, mask_mod=E.causal_mask(),
                 score_mod=E.softcap_score(3.0))
    q, k, v = tensors(op, seed=page + Sq)
    g = torch.Generator().manual_seed(9)
    table = torch.randperm(P, generator=g)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    lens = torch.tensor([max_pages * page, 0, page + 3], dtype=torch.int32)
    out, lse, _ = check(op, q, k, v, {"block_table": table, "seqlens_k": lens})
    assert torch.all(out[1] == 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("page,block_n,splits", [(8, 32, 1), (16, 64, 1), (16, 64, 3), (16, 32, 4)])
def test_paged_pages_smaller_than_a_tile(page, block_n, splits):
    """Key tiles spanning several pages (the H200 table's 64-key tiles over pages of 16): a page id per key,
    tails inside a page, an empty sequence, split and unsplit, against the float64 reference."""
    from dataclasses import replace

    from portakern.backends.triton.attention import forward as F, plan

    B, max_pages, Hq, Hkv, D = 3, 12, 8, 2, 32
    P = B * max_pages + 3
    op = make_op(B=B, Sq=1, Sk=max_pages * page, Hq=Hq, Hkv=Hkv, D=D, kv_layout=KVLayout.PAGED,
                 page_size=page, num_pages=P, has_seqlens_k=True, score_mod=E.softcap_score(3.0))
    q, k, v = tensors(op, seed=page + block_n + splits)
    g = torch.Generator().manual_seed(11)
    aux = {"block_table": torch.randperm(P, generator=g)[: B * max_pages].reshape(B, max_pages).to(torch.int32),
           "seqlens_k": torch.tensor([max_pages * page, 0, 3 * page + 5], dtype=torch.int32)}
    cfg = replace(plan.for_device(op, CPU), block_n=block_n, num_splits=splits, fused_combine=False)
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=torch.float16)
    lse = torch.full(s["lse"], float("nan"))
    F.build(op, CPU, cfg)(q, k, v, out, lse, dict(aux))
    ref_out, ref_lse = run_reference(op, q, k, v, aux)
    assert not torch.isnan(out).any()
    assert np.abs(out.double().numpy() - ref_out).max() < ATOL[op.dtype]
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse.double().numpy()), np.isneginf(ref_lse))
    assert np.abs(lse.double().numpy()[fin] - ref_lse[fin]).max() < LSE_ATOL
    assert torch.all(out[1] == 0)


# -- varlen ---------------------------------------------------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_padding_rows(causal):
    lens_q, lens_k = [7, 0, 19, 1], [30, 4, 19, 0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int64)
    total_q, total_k = int(cu_q[-1]) + 3, int(cu_k[-1])     # 3 padding rows after the last sequence
    op = make_op(B=4, Sq=total_q, Sk=total_k, Hq=4, Hkv=2, D=32, kv_layout=KVLayout.VARLEN,
                 total_q=total_q, total_k=total_k, mask_mod=E.causal_mask() if causal else None)
    out, lse, _ = check(op, *tensors(op), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    assert torch.all(out[-3:] == 0) and torch.all(torch.isneginf(lse[:, -3:]))


@pytest.mark.interpreter
def test_varlen_decode_packs_heads():
    B, Hq, Hkv = 5, 8, 2
    lens_k = [40, 3, 77, 1, 60]
    cu_q = torch.arange(B + 1, dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    op = make_op(B=B, Sq=B, Sk=sum(lens_k), Hq=Hq, Hkv=Hkv, D=32, kv_layout=KVLayout.VARLEN, total_q=B,
                 total_k=sum(lens_k), mask_mod=E.causal_mask())
    _, _, kern = check(op, *tensors(op), {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    assert kern.config.pack == Hq // Hkv


# -- public API, supports, lowering --------------------------------------------------------------------

@needs_compiler
def test_supports_gives_reasons():
    from portakern.backends.triton import attention as A

    op = make_op(D=320)
    s = A.supports(op, CPU)
    assert not s and "head_dim=320" in s.reason and "backend=\"cpu\"" in s.reason


@needs_compiler
def test_mask_analysis_recognises_library_masks():
    from portakern.backends.triton.expr_triton import analyse_mask

    assert analyse_mask(E.causal_mask()).right == 0 and analyse_mask(E.causal_mask()).left is None
    w = analyse_mask(E.window_mask(5, 3))
    assert (w.left, w.right, w.residual) == (5, 3, False)
    cw = analyse_mask(E.causal_mask() & E.window_mask(7, 2) & E.window_mask(4, -1))
    assert (cw.left, cw.right, cw.residual) == (4, 0, False)
    assert analyse_mask(E.prefix_lm_mask(3)).residual
    assert analyse_mask(E.causal_mask() & (E.kv_idx > 2)) == type(w)(None, 0, True, False)


@needs_compiler
def test_generated_source_types():
    from portakern.backends.triton.expr_triton import generate_source

    src = generate_source(E.where(E.q_idx > 3, E.score, 1) + (E.kv_idx < 2), ~(E.kv_idx.eq(E.h)))
    assert "def score_mod" in src and "def mask_mod" in src and ".to(tl.int32)" in src
    assert "_INF" in generate_source(E.where(E.kv_idx > 0, E.score, float("-inf")), None)


@needs_compiler
@pytest.mark.parametrize("target,op,needle", [
    ("sm_90a", dict(B=2, Sq=512, Sk=512, Hq=8, Hkv=2, D=128, dtype=DType.bfloat16, mask_mod=E.causal_mask()),
     "wgmma"),
    ("sm_80", dict(B=1, Sq=1, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.float16, kv_layout=KVLayout.PAGED,
                   page_size=16, num_pages=1024, has_seqlens_k=True), "mma.sync"),
    ("sm_100a", dict(B=1, Sq=256, Sk=256, Hq=4, Hkv=4, D=64, dtype=DType.float16), "tcgen05"),
], ids=["sm_90a-prefill", "sm_80-paged-decode", "sm_100a-prefill"])
def test_compile_for_target(target, op, needle):
    from portakern.backends.triton import attention as A

    art = A.compile_for_target(make_op(**op), target)
    fwd = art["kernels"]["attn_fwd_wgmma" if art["config"]["wgmma"] else "attn_fwd"]   # sm_90a prefill: Gluon
    assert isinstance(fwd["cubin"], bytes) and len(fwd["cubin"]) > 1000
    assert needle in fwd["ptx"]
    cfg = art["config"]
    assert (cfg["num_splits"] > 1 and not cfg["fused_combine"]) == ("attn_combine" in art["kernels"])
    if cfg["num_splits"] > 1 and cfg["fused_combine"]:
        assert "atom" in fwd["ptx"]   # the last split's arrival counter


@needs_compiler
def test_compile_for_target_with_programmatic_dependent_launch():
    """pdl=True lowers attn_fwd and attn_combine with griddepcontrol.wait before any global read
    (attn_fwd also with griddepcontrol.launch_dependents); without it neither appears."""
    from dataclasses import replace

    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    op = make_op(B=1, Sq=1, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    base = replace(plan.choose(op, "sm_90", 132), fused_combine=False)
    assert base.num_splits > 1
    for pdl in (True, False):
        art = A.compile_for_target(op, "sm_90a", replace(base, pdl=pdl))
        assert art["config"]["pdl"] is pdl
        fwd, comb = art["kernels"]["attn_fwd"]["ptx"], art["kernels"]["attn_combine"]["ptx"]
        assert ("griddepcontrol.launch_dependents" in fwd) is pdl
        assert ("griddepcontrol.wait" in comb) is pdl
        assert ("griddepcontrol.wait" in fwd) is pdl
        if pdl:
            for ptx in (fwd, comb):
                body = ptx[ptx.index(".entry"):]
                assert body.index("griddepcontrol.wait") < body.index("ld.global")   # waits before any read


@needs_compiler
def test_compile_for_target_lowers_what_a_contiguous_launch_runs():
    """compile_for_target specialises like a launch on contiguous tensors (aligned pointers, strides and
    lengths divisible by 16 marked, integers equal to 1 constant): the D=128 prefill tile then lowers its
    K/V tiles to 16-byte cp.async copies, not 2-byte loads (what it lowered before the marks); B=1 decode
    gets batch = seqlen_q = 1 as constants and its 8192 keys marked divisible by 16."""
    import re

    from portakern.backends.triton import attention as A
    from portakern.backends.triton import kernels
    from portakern.backends.triton.attention import forward as F, plan, specialise as S
    from portakern.backends.triton.expr_triton import load_mods

    op = make_op(B=4, Sq=4096, Sk=4096, Hq=32, Hkv=32, D=128, dtype=DType.bfloat16)
    cfg = plan.choose(op, "sm_90", 132, wgmma=False)   # attn_fwd's tile (the table runs the Gluon kernel)
    ptx = A.compile_for_target(op, "sm_90a", cfg)["kernels"]["attn_fwd"]["ptx"]
    assert len(re.findall(r"cp\.async\.c[ga]\.shared\.global\S* \[[^]]*\], \[[^]]*\], 0x10", ptx)) >= 16
    assert "ld.global.b16" not in ptx

    fwd = kernels.load("attention_fwd").attn_fwd
    dec = make_op(B=1, Sq=1, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    tensors_ = {n: "*bf16" for n in ("Q", "K", "V", "O")}
    absent = {n: None for n in fwd.arg_names[4:fwd.arg_names.index("stride_qb")]}   # LSE ... V_DESC
    cx = F.constexprs(dec, plan.choose(dec, "sm_90", 132), False, load_mods(None, None, False))
    sig, consts, attrs = S.as_launched(fwd, tensors_, {**absent, **cx}, S.launch_scalars(dec))
    assert consts["batch"] == consts["seqlen_q"] == 1 and sig["seqlen_k"] == "i32" and sig["scale"] == "fp32"
    assert attrs[(fwd.arg_names.index("seqlen_k"),)] == [["tt.divisibility", 16]]
    assert (fwd.arg_names.index("Q"),) in attrs and (fwd.arg_names.index("stride_qh"),) in attrs
    wide = S.launch_scalars(make_op(B=2, Sq=3, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16))
    assert (wide["stride_qs"], wide["stride_kb"], wide["total_rows"]) == (32 * 128, 8192 * 8 * 128, 6)


def test_pdl_is_refused_where_it_cannot_run():
    from dataclasses import replace

    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import forward as F, plan

    op = make_op(B=1, Sq=1, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    cfg = replace(plan.choose(op, "sm_80", 108), pdl=True)
    with pytest.raises(ValueError, match=r"pdl=True\) on sm_80.*sm_90.*use pdl=False"):
        A.compile_for_target(op, "sm_80", cfg)
    with pytest.raises(ValueError, match=r"pdl=True\) on interp"):
        F.build(op, CPU, replace(plan.for_device(op, CPU), pdl=True))


@needs_compiler
@pytest.mark.parametrize("pdl,fused", [(False, False), (True, False), (True, True)],
                         ids=["plain-merge", "pdl-merge", "pdl-fused-merge"])
def test_gpu_split_decode_replayed_in_a_cuda_graph(pdl, fused):
    """On a CUDA device: decode with the separate merge kernel (optionally both kernels as
    programmatic dependent launches) or merged by the last split (its counters reset for the next
    replay), captured in a graph behind the copies that write its q, k and v (so a dependent launch
    that read before waiting would see stale inputs), replayed with new inputs, against float64."""
    from dataclasses import replace

    from portakern.backends.triton.attention import forward as F, plan
    from portakern.devices import detect_devices

    devs = [d for d in detect_devices() if d.type == "cuda"]
    if not devs:
        pytest.skip("no CUDA device on this machine: the interpreter tests cover the kernels' logic")
    dev = devs[0]
    if pdl and tuple(dev.capability) < (9, 0):
        pytest.skip(f"programmatic dependent launch needs sm_90+, this device is {dev.arch}")
    op = make_op(B=1, Sq=1, Sk=4096, Hq=8, Hkv=2, D=128, dtype=DType.bfloat16, mask_mod=E.causal_mask(),
                 return_lse=True)
    cfg = replace(plan.for_device(op, dev), num_splits=16, fused_combine=fused, pdl=pdl)
    kern = F.build(op, dev, cfg)
    cuda = torch.device(str(dev))
    q, k, v = (t.to(cuda) for t in tensors(op, seed=1))
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=torch.bfloat16, device=cuda)
    lse = torch.full(s["lse"], float("nan"), device=cuda)
    staged = [torch.empty_like(t) for t in (q, k, v)]
    kern(q, k, v, out, lse, {})                     # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for dst, src in zip((q, k, v), staged):   # the kernels right before attention write its inputs
            dst.copy_(src)
        kern(q, k, v, out, lse, {})
    for seed in (2, 3):
        q2, k2, v2 = tensors(op, seed=seed)
        for dst, src in zip(staged, (q2, k2, v2)):
            dst.copy_(src.to(cuda))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = run_reference(op, q2, k2, v2)
        assert np.abs(out.double().cpu().numpy() - ref_out).max() <= ATOL[op.dtype]
        assert np.abs(lse.double().cpu().numpy() - ref_lse).max() <= LSE_ATOL


@pytest.mark.interpreter
@pytest.mark.parametrize("scale", [0.8, -0.8], ids=["positive-scale", "negative-scale"])
def test_both_softmax_paths_match_the_reference(scale):
    """A positive scale without score_mod takes the row maximum on the raw scores (``RAW_MAX``: one FFMA per
    score for the exponent); a negative one reverses the order of the scores and takes the scaled path.
    Both against float64, causal with a partial last tile so the masked walk runs too."""
    op = make_op(B=2, Sq=37, Sk=53, Hq=4, Hkv=2, D=32, scale=scale, mask_mod=E.causal_mask())
    check(op, *tensors(op, seed=5))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["prefill-causal-fp16", "prefill-window-bf16", "decode-split-fp32", "paged-fp16"])
def test_lazy_rescale_matches_the_reference(case):
    """``lazy_rescale`` (stale row maxima until a tile raises one by > 2^8) on scores wide enough
    that both the skipped and the taken rescale happen, with fully masked rows and tiles."""
    from dataclasses import replace

    from portakern.backends.triton.attention import forward as F, plan

    aux = {}
    if case == "prefill-causal-fp16":
        op = make_op(B=1, Sq=70, Sk=90, Hq=2, Hkv=1, D=32, scale=1.5, mask_mod=E.causal_mask())
    elif case == "prefill-window-bf16":
        op = make_op(B=2, Sq=40, Sk=40, Hq=2, Hkv=2, D=64, scale=0.9, dtype=DType.bfloat16,
                     mask_mod=E.window_mask(5, 0))
    elif case == "decode-split-fp32":
        op = make_op(B=2, Sq=1, Sk=300, Hq=4, Hkv=1, D=32, scale=2.0, dtype=DType.float32)
    else:
        page, P = 16, 12
        op = make_op(B=2, Sq=1, Sk=5 * page, Hq=4, Hkv=2, D=32, scale=1.7, kv_layout=KVLayout.PAGED,
                     page_size=page, num_pages=P, has_seqlens_k=True)
        g = torch.Generator().manual_seed(4)
        aux = {"block_table": torch.randperm(P, generator=g)[:10].reshape(2, 5).to(torch.int32),
               "seqlens_k": torch.tensor([5 * page, 2 * page + 1], dtype=torch.int32)}
    q, k, v = tensors(op, seed=11)
    k = k * torch.linspace(0.2, 3.0, k.shape[1]).reshape(1, -1, 1, 1).to(k.dtype)   # maxima grow along keys
    s = op.shapes()
    res = {}
    for lazy in (True, False):
        out = torch.full(s["out"], float("nan"), dtype=TORCH_DTYPE[op.dtype])
        lse = torch.full(s["lse"], float("nan"))
        F.build(op, CPU, replace(plan.for_device(op, CPU), lazy_rescale=lazy))(q, k, v, out, lse, dict(aux))
        res[lazy] = out.double().numpy(), lse.double().numpy()
    ref_out, ref_lse = run_reference(op, q, k, v, aux)
    out, got = res[True]
    # scores this wide cost the bf16 case a little more than ATOL against float64 with or without lazy
    assert np.abs(out - ref_out).max() <= 2 * ATOL[op.dtype]
    assert np.abs(out - res[False][0]).max() <= ATOL[op.dtype]
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(got), fin)
    assert np.abs(got[fin] - ref_lse[fin]).max() <= LSE_ATOL
