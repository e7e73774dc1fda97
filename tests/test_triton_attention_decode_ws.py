"""The Gluon split-KV decode kernel for sm_90 (``AttnConfig.decode_ws``, ``kernels/attention_decode_ws.py``).

Gluon kernels have no interpreter, so off the GPU these tests check which ops the kernel serves
(``attention_decode_ws.blocker``, the sm_90 table's split paged decode, ``check_decode_ws``, ``fit``, the
workspace) and its sm_90a lowering (a load warp's TMA copies, one per page of 16 in a 64-key tile, and
wgmma); on an sm_90 GPU it runs against the float64 cpu kernel with poisoned outputs and NaN in the K/V
rows past each sequence, inside a CUDA graph replayed with new inputs, and falls back to attn_fwd with
a warning for a K without a row-major view.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from portakern.ir import DType, KVLayout  # noqa: E402
from portakern.ir import expr as E  # noqa: E402
from triton_helpers import ATOL, LSE_ATOL, make_op, needs_compiler, run_reference, sm90_device  # noqa: E402


def paged(B=1, L=8192, page=16, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16, **kw):
    return make_op(B=B, Sq=1, Sk=L, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, kv_layout=KVLayout.PAGED, page_size=page,
                   num_pages=B * L // page + 3, has_seqlens_k=True, **kw)


def test_sm90_table_runs_split_paged_decode_on_the_gluon_kernel():
    """``SPLIT_PAGED_WS``: split paged decode of 16-bit K/V on sm_90 takes the Gluon kernel (64-key tiles, 4
    stages, one program per SM: 16 splits for 8 KV heads), its merge a separate ``attn_combine`` launch that
    the decode kernel launches at its start and that releases the next kernel before its wait
    (``RELEASE_NEXT_TABLE``, ``EARLY_MERGE_TABLE``); dense
    keys, unsplit batches, fp32, other families and ``wgmma=False`` keep attn_fwd."""
    from portakern.backends.triton.attention import plan, rules as R

    for kw in ({}, dict(page=64), dict(L=32768), dict(page=128, L=32768), dict(dtype=DType.float16)):
        c = plan.choose(paged(**kw), "sm_90", 132)
        assert c.decode_ws and (c.block_n, c.num_stages, c.num_warps, c.num_splits) == (64, 4, 4, 16), (kw, c)
        assert not (c.fused_combine or c.pdl or c.wgmma or c.tma)
        assert c.release_next and c.early_merge                    # the merge lets the next kernel launch early
        R.check_decode_ws(paged(**kw), c, "sm_90")
    c = plan.choose(paged(L=2048 + 64, page=64), "sm_90", 132)
    assert c.decode_ws and c.num_splits == 11                      # 33 tiles, at least 3 per split
    c = plan.choose(paged(D=256), "sm_90", 132)
    assert c.decode_ws and c.num_stages == 3                       # 4 stages of 64 keys do not fit at D=256
    dense = make_op(B=1, Sq=1, Sk=8192, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    for op, arch in ((dense, "sm_90"), (paged(B=64, L=4096), "sm_90"), (paged(dtype=DType.float32), "sm_90"),
                     (paged(), "sm_80"), (paged(), "sm_100"), (paged(), "interp")):
        assert not plan.choose(op, arch, 132).decode_ws, (op, arch)
    c = plan.choose(paged(), "sm_90", 132, wgmma=False)
    assert not c.decode_ws and c.num_splits == 32                  # attn_fwd's split paged tile
    # the workspace: partials and log-sum-exps of 16 splits, no arrival counters
    assert plan.workspace_bytes(paged(), plan.choose(paged(), "sm_90", 132)) == 4 * 16 * 1 * 32 * (128 + 1)


def test_autotuning_times_the_gluon_kernel_and_attn_fwd():
    """For split paged decode on sm_90 the candidates start with the table's Gluon configuration and include
    attn_fwd's table configuration; every candidate passes the checks of its kernel."""
    from portakern.backends.triton.attention import autotune as AT, config as C, plan, rules as R
    from portakern.backends.triton.common.arch import check_pdl

    op = paged()
    cands = AT.candidates(op, "sm_90", 132)
    assert cands[0] == plan.choose(op, "sm_90", 132) and cands[0].decode_ws
    assert plan.choose(op, "sm_90", 132, wgmma=False) in cands
    assert any(c.decode_ws and c.block_n == 128 for c in cands) and sum(not c.decode_ws for c in cands) > 3
    for c in cands:
        R.check_decode_ws(op, c, "sm_90")
        check_pdl(c, "sm_90")
        assert C.AttnConfig(**c.to_json()) == c
    assert not any(c.decode_ws for c in AT.candidates(op, "sm_80", 108))


@pytest.mark.parametrize("arch,op,block_n,match", [
    ("sm_80", dict(), 64, r"needs sm_90 \(wgmma, TMA\), not sm_80"),
    ("sm_90", dict(prefill=True), 64, r"one query row per sequence \(decode\) over dense or paged K/V only"),
    ("sm_90", dict(dtype=DType.float32), 64, r"bf16/fp16 only, not float32"),
    ("sm_90", dict(D=96), 64, r"head_dim == head_dim_v in \(64, 128, 256\) only"),
    ("sm_90", dict(Hq=128, Hkv=1), 64, r"at most 64 query heads per KV head, not 128"),
    ("sm_90", dict(score_mod=E.softcap_score(30.0)), 64, r"no score_mod and a positive scale only"),
    ("sm_90", dict(mask_mod=E.window_mask(128, 0)), 64, r"no mask or the causal mask only"),
    ("sm_90", dict(page=48), 64, r"pages of a multiple of 8 rows dividing or divided by the 64-key tile, not 48"),
    ("sm_90", dict(), 256, r"block_n 32, 64 or 128, not 256"),
], ids=["sm80", "prefill", "fp32", "d96", "group-128", "score-mod", "window", "page-48", "bn256"])
def test_blocker_names_what_the_kernel_does_not_serve(arch, op, block_n, match):
    from portakern.backends.triton.attention import config as C, decode_ws as DW, rules as R

    op = dict(op)
    if op.pop("prefill", False):
        op = make_op(B=1, Sq=4, Sk=4096, Hq=32, Hkv=8, D=128, dtype=DType.bfloat16)
    else:
        L = 48 * 64 if op.get("page") == 48 else 8192
        op = paged(L=L, **op)
    assert DW.blocker(op, "sm_90" if arch == "sm_90" else arch, block_n) is not None
    with pytest.raises(ValueError, match=r"AttnConfig\(decode_ws=True\): the Gluon decode kernel does not serve this "
                                         r"op \(" + match + r"\); use decode_ws=False or pass the config through "
                                                            r"attention\.plan\.fit"):
        R.check_decode_ws(op, C.AttnConfig(16, block_n, 4, 4, pack=4, num_splits=16, decode_ws=True), arch)
    assert DW.blocker(paged(mask_mod=E.causal_mask()), "sm_90") is None        # hides no key from the last row


def test_check_and_fit_keep_the_ring_in_shared_memory():
    from portakern.backends.triton.attention import config as C, plan, rules as R

    op = paged(D=256)
    big = C.AttnConfig(16, 64, 4, 4, pack=4, num_splits=16, decode_ws=True)
    with pytest.raises(ValueError, match=r"the Gluon decode kernel with block_n=64 and num_stages=4 needs 295936 "
                                         r"bytes of shared memory, over sm_90's 232448"):
        R.check_decode_ws(op, big, "sm_90")
    assert plan.fit(op, big, "sm_90") == replace(big, num_stages=3)
    with pytest.raises(ValueError, match=r"decode kernel needs num_stages >= 2, not 1"):
        R.check_decode_ws(paged(), replace(big, num_stages=1), "sm_90")
    with pytest.raises(ValueError, match=r"has its own TMA loads and schedule: wgmma, tma and lazy_rescale stay off"):
        R.check_decode_ws(paged(), replace(big, tma=True), "sm_90")
    dense_prefill = make_op(B=1, Sq=64, Sk=64, Hq=2, Hkv=2, D=64, dtype=DType.bfloat16)
    assert plan.fit(dense_prefill, big, "sm_90") == plan.choose(dense_prefill, "sm_90", wgmma=False)


@needs_compiler
@pytest.mark.parametrize("page", [16, 64])
def test_lowering_for_sm90a_has_a_load_warp_per_page_copies_and_wgmma(page):
    """The table's choice lowers to the Gluon kernel and the merge: TMA copies (one K and one V box per
    page of 16, four per 64-key tile; one per tile for pages of 64), mbarrier waits, setmaxnreg, wgmma."""
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import config as C

    op = paged(page=page, return_lse=True)
    art = A.compile_for_target(op, "sm_90a")
    assert art["config"]["decode_ws"] and sorted(art["kernels"]) == ["attn_combine", "attn_decode_ws"]
    k = art["kernels"]["attn_decode_ws"]
    ptx = k["ptx"]
    boxes = 64 // min(page, 64)
    # every box of D=128 bf16 is two 128-byte-swizzled copies; q is one box
    assert ptx.count("cp.async.bulk.tensor") == 2 * (1 + 2 * boxes), ptx.count("cp.async.bulk.tensor")
    assert "mbarrier.try_wait" in ptx and "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") >= 16
    assert k["shared"] <= 227 * 1024 and k["cubin"]
    assert "attn_fwd" in A.compile_for_target(op, "sm_80")["kernels"]      # other targets: the Triton kernel
    # a configuration asking for the fused merge still merges in attn_combine (the kernel has no fused merge)
    own = C.AttnConfig(16, 64, 4, 3, pack=4, num_splits=8, fused_combine=True, pdl=True, decode_ws=True)
    dep = A.compile_for_target(op, "sm_90a", own)["kernels"]
    assert sorted(dep) == ["attn_combine", "attn_decode_ws"]
    # pdl: the kernel waits for the previous one (once per thread, before any global read) and lets the
    # merge launch; the table's (early_merge, no pdl) only lets the merge launch
    assert "griddepcontrol.wait" not in ptx and ptx.count("griddepcontrol.launch_dependents") == 1
    dptx = dep["attn_decode_ws"]["ptx"]
    assert dptx.count("griddepcontrol.wait") == 1 and dptx.count("griddepcontrol.launch_dependents") == 1
    assert dptx.index("griddepcontrol.wait") < min(dptx.index("ld.global"), dptx.index("cp.async.bulk.tensor"))
    assert "griddepcontrol.wait" in dep["attn_combine"]["ptx"]


@needs_compiler
@pytest.mark.parametrize("kernel", ["decode_ws", "attn_fwd"])
def test_release_next_puts_one_launch_dependents_in_the_merge_and_nowhere_else(kernel):
    """``release_next`` lowers ``griddepcontrol.launch_dependents`` into ``attn_combine`` (after its wait when the
    merge is itself a dependent, before its first global read) and changes no other kernel; without it the
    merge has none."""
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    op = paged(L=2048, page=64, return_lse=True)
    table = plan.choose(op, "sm_90", 132, wgmma=kernel == "decode_ws")
    assert table.release_next is (kernel == "decode_ws")      # RELEASE_NEXT_TABLE: the Gluon kernel's merge
    base = replace(table, release_next=False, early_merge=False)
    assert base.decode_ws is (kernel == "decode_ws") and base.num_splits > 1 and not base.fused_combine
    plain = A.compile_for_target(op, "sm_90a", base)["kernels"]
    early = A.compile_for_target(op, "sm_90a", replace(base, release_next=True))["kernels"]
    assert "griddepcontrol.launch_dependents" not in plain["attn_combine"]["ptx"]
    merge = early["attn_combine"]["ptx"]
    body = merge[merge.index(".entry"):]
    assert body.count("griddepcontrol.launch_dependents") == 1
    assert body.index("griddepcontrol.launch_dependents") < body.index("ld.global")
    if base.pdl:            # attn_fwd's table launches the merge as its dependent: wait first, then release
        assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")
    first = next(n for n in plain if n != "attn_combine")
    assert early[first]["ptx"] == plain[first]["ptx"]


def test_release_next_needs_grid_dependency_control():
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    op = paged(L=2048, page=64)
    cfg = replace(plan.choose(op, "sm_80", 108), release_next=True)
    with pytest.raises(ValueError, match=r"AttnConfig\(release_next=True\) on sm_80: .*sm_90.*use release_next=False"):
        A.compile_for_target(op, "sm_80", cfg)


def test_checks_run_once_per_layout(monkeypatch):
    """The Gluon path's per-call checks (shapes, strides, index arrays, TMA's rules) run when a call's layout key
    differs from the last that passed them, and are skipped otherwise: new tensors of the same layout launch
    straight away; a wrong shape still raises, a misaligned q still falls back to attn_fwd (kernels stand-ins)."""
    from portakern.backends.triton.attention import config as C, decode_ws as W, forward as F, plan
    from portakern.devices import CPU
    from portakern.errors import InvalidInputError

    log = []
    monkeypatch.setattr(W, "launcher", lambda op, cfg, cc: lambda *a: log.append("gluon"))
    real_blocker = W.call_blocker
    monkeypatch.setattr(W, "call_blocker", lambda *a: log.append("checked") or real_blocker(*a))
    monkeypatch.setattr(plan, "family", lambda device: ("sm_90", 132))
    monkeypatch.setattr(F, "build_at", lambda op, device, cfg: lambda *a: log.append("attn_fwd"))
    op = paged(L=1024, page=64, return_lse=False)
    cfg = C.AttnConfig(16, 64, 4, 2, pack=op.group_size, num_splits=8, decode_ws=True)
    kern = F.build_gluon(op, CPU, cfg, "sm_90")
    s = op.shapes()

    def call(q=None):
        q = torch.randn(s["q"]).to(torch.bfloat16) if q is None else q
        k, v = (torch.randn(s[n]).to(torch.bfloat16) for n in ("k", "v"))
        aux = {"block_table": torch.zeros(s["block_table"], dtype=torch.int32),
               "seqlens_k": torch.ones(s["seqlens_k"], dtype=torch.int32)}
        kern(q, k, v, torch.empty(s["out"], dtype=torch.bfloat16), None, aux)

    call()
    call()
    assert log == ["checked", "gluon", "gluon"]
    with pytest.raises(InvalidInputError, match="q has shape"):
        kern(torch.empty(1, 1, 8, 128, dtype=torch.bfloat16), *(torch.empty(s[n], dtype=torch.bfloat16)
                                                                 for n in ("k", "v", "out")), None, {})
    log.clear()
    buf = torch.empty(op.heads_q * op.head_dim + 8, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="not 16-byte aligned"):   # 8 bytes in
        call(buf[4:4 + op.heads_q * op.head_dim].view(s["q"]))
    assert log == ["checked", "attn_fwd"]
    call()   # the layout that passed before: no checks
    assert log == ["checked", "attn_fwd", "gluon"]

    # an output 8 bytes off passes (the kernel stores it without TMA), and its layout key must not let a later
    # call with q 8 bytes off and the output aligned skip the checks: the key keeps each tensor's offset
    def off8(shape):
        n = int(torch.tensor(shape).prod())
        b = torch.empty(n + 16, dtype=torch.bfloat16)
        start = ((-b.data_ptr()) % 16 + 8) // 2
        return b[start:start + n].view(shape)

    log.clear()
    q, k, v = (torch.randn(s[n]).to(torch.bfloat16) for n in ("q", "k", "v"))
    aux = {"block_table": torch.zeros(s["block_table"], dtype=torch.int32),
           "seqlens_k": torch.ones(s["seqlens_k"], dtype=torch.int32)}
    out8, q8 = off8(s["out"]), off8(s["q"])
    q8.copy_(q)
    assert out8.data_ptr() % 16 == 8 and q8.data_ptr() % 16 == 8
    kern(q, k, v, out8, None, aux)
    with pytest.warns(RuntimeWarning, match="not 16-byte aligned"):
        kern(q8, k, v, torch.empty(s["out"], dtype=torch.bfloat16), None, aux)
    assert log == ["checked", "gluon", "checked", "attn_fwd"]
    # a q of another dtype of the same size is a new key and is refused by name, not run as the op's bf16
    with pytest.raises(InvalidInputError, match=r"q has dtype torch.float16, but this attention op was compiled "
                                                r"for bfloat16"):
        kern(q.to(torch.float16), k, v, torch.empty(s["out"], dtype=torch.bfloat16), None, aux)


@needs_compiler
def test_rebased_descriptors_equal_fresh_ones_and_hold_no_tensor():
    """The launcher builds the three TMA descriptors once and later gives each call a copy over its own tensors:
    the copy has every field of the descriptor ``descriptors`` builds for those tensors, and the kept template
    holds no tensor (it would keep the first call's KV cache alive)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from portakern.backends.triton.attention import decode_ws as W

    op = paged(L=2048, page=64)
    s = op.shapes()

    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s[n], generator=g).to(torch.bfloat16) for n in ("q", "k", "v")]

    template = W._templates(W.descriptors(op, *tensors(0), 64))
    assert all(t.base is None for t in template)
    new = tensors(1)
    for t, fresh, a in zip(template, W.descriptors(op, *new, 64), new):
        d = W._rebased(t, a)
        assert type(d) is type(fresh) and d.base is a
        assert vars(d) == vars(fresh)


@needs_compiler
def test_early_merge_launches_the_merge_at_the_kernels_start_and_the_next_kernel_before_the_merges_wait():
    """``early_merge``: the decode kernel (launched normally) says ``launch_dependents`` before any global read or
    TMA copy; the merge is then a dependent that releases the next kernel before its own wait and reads the
    partials only after it. Without it the decode kernel has no grid dependency control."""
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    op = paged(L=2048, page=64, return_lse=True)
    table = plan.choose(op, "sm_90", 132, wgmma=True)
    assert table.decode_ws and table.release_next and not table.pdl and table.early_merge   # EARLY_MERGE_TABLE
    plain = A.compile_for_target(op, "sm_90a", replace(table, early_merge=False))["kernels"]
    early = A.compile_for_target(op, "sm_90a", table)["kernels"]
    assert "griddepcontrol" not in plain["attn_decode_ws"]["ptx"]
    dec = early["attn_decode_ws"]["ptx"]
    dec = dec[dec.index(".entry"):]
    assert dec.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in dec
    assert dec.index("griddepcontrol.launch_dependents") < min(dec.index("ld.global"),
                                                               dec.index("cp.async.bulk.tensor"))
    merge = early["attn_combine"]["ptx"]
    merge = merge[merge.index(".entry"):]
    assert merge.count("griddepcontrol.launch_dependents") == 1 and merge.count("griddepcontrol.wait") == 1
    assert merge.index("griddepcontrol.launch_dependents") < merge.index("griddepcontrol.wait") \
        < merge.index("ld.global")
    # without it the merge (not a dependent) releases before its first read and waits for nothing
    pm = plain["attn_combine"]["ptx"]
    assert "griddepcontrol.wait" not in pm and pm.count("griddepcontrol.launch_dependents") == 1


def test_autotuning_candidates_keep_early_merge_only_with_a_separate_merge():
    """The autotuner derives split counts from the table's (halved, doubled): a candidate left with one split
    drops ``early_merge`` (which would be refused), the others keep the table's launch options."""
    from portakern.backends.triton.attention import autotune as AT
    from portakern.backends.triton.common.arch import check_pdl

    unsplit = 0
    for op in (paged(L=2048 + 64, page=64), paged(L=256, page=64), paged()):
        cands = AT.candidates(op, "sm_90", 132)
        assert cands[0].decode_ws and cands[0].num_splits > 1 and cands[0].early_merge
        for c in cands:
            check_pdl(c, "sm_90")
            assert c.early_merge == (c.decode_ws and c.num_splits > 1), c
            unsplit += c.decode_ws and c.num_splits == 1
    assert unsplit        # 256 keys: the table's 2 splits halved


@pytest.mark.parametrize("arch, changes, match", [
    ("sm_80", {"release_next": False}, r"AttnConfig\(early_merge=True\) on sm_80: .*grid dependency control.*use early_merge=False"),
    ("sm_90a", {"decode_ws": False}, r"AttnConfig\(early_merge=True, decode_ws=False, num_splits=\d+\): .*Gluon "
                                    r"decode kernel.*use early_merge=False"),
    ("sm_90a", {"num_splits": 1}, r"AttnConfig\(early_merge=True, decode_ws=True, num_splits=1\): .*num_splits >= 2"),
])
def test_early_merge_is_refused_where_it_cannot_run(arch, changes, match):
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    op = paged(L=2048, page=64)
    cfg = replace(plan.choose(op, "sm_90", 132, wgmma=True), early_merge=True, **changes)
    with pytest.raises(ValueError, match=match):
        A.compile_for_target(op, arch, cfg)


# -- on an sm_90 GPU ------------------------------------------------------------------------------------

def _gpu():
    return sm90_device("the Gluon decode kernel")


def _inputs(op, lens, seed):
    """CPU q, K/V with NaN in every row past each sequence's length, a shuffled block table, the lengths."""
    g = torch.Generator().manual_seed(seed)
    s = op.shapes()
    q, k, v = (torch.randn(s[n], generator=g).to(torch.bfloat16 if op.dtype is DType.bfloat16 else torch.float16)
               for n in ("q", "k", "v"))
    table = torch.randperm(op.num_pages, generator=g)[: op.batch * op.max_pages].reshape(op.batch, op.max_pages)
    table = table.to(torch.int32)
    for b, n in enumerate(lens):
        for j in range(op.max_pages):
            lo = max(0, n - j * op.page_size)
            if lo < op.page_size:
                k[table[b, j], lo:] = float("nan")
                v[table[b, j], lo:] = float("nan")
    return q, k, v, {"block_table": table, "seqlens_k": torch.tensor(lens, dtype=torch.int32)}


def _reference(op, q, k, v, aux):
    return run_reference(op, q, k.nan_to_num(0.0), v.nan_to_num(0.0), aux)


@needs_compiler
@pytest.mark.parametrize("case", [
    dict(B=3, L=1024, page=16, Hq=32, Hkv=8, D=128, lens=[1024, 937, 1], splits=8, stages=4),
    dict(B=2, L=2048, page=64, Hq=16, Hkv=2, D=128, lens=[2048, 129], splits=16, stages=3, dtype=DType.float16,
         index=torch.int64),
    dict(B=2, L=512, page=128, Hq=8, Hkv=8, D=64, lens=[300, 512], splits=4, stages=2),
    dict(B=2, L=1024, page=32, Hq=16, Hkv=4, D=256, lens=[1000, 33], splits=6, stages=3),
    dict(B=1, L=256, page=16, Hq=64, Hkv=1, D=128, lens=[200], splits=32, stages=2),
    dict(B=2, L=1024, page=16, Hq=32, Hkv=8, D=128, lens=[1024, 500], splits=16, stages=4, table_step=3),
], ids=["p16-tails-one-key", "p64-fp16-int64-index", "p128-d64", "p32-d256", "mqa64-empty-splits",
        "strided-block-table"])
def test_gpu_matches_the_float64_reference(case):
    """Lengths ending inside a page and a tile, one key, splits with no keys (32 splits of 4 tiles), GQA and
    MQA with 64 query heads, a block table whose pages are not adjacent in memory, int64 index arrays; NaN
    past every sequence must not reach the output; outputs poisoned first."""
    from portakern.backends.triton.attention import config as C, forward as F

    dev = _gpu()
    case = dict(case)
    lens, splits, stages = case.pop("lens"), case.pop("splits"), case.pop("stages")
    step = case.pop("table_step", 1)
    index = case.pop("index", torch.int32)
    op = paged(**case, return_lse=True)
    q, k, v, aux = _inputs(op, lens, seed=7)
    ref_out, ref_lse = _reference(op, q, k, v, aux)
    cuda = torch.device(str(dev))
    q, k, v = (t.to(cuda) for t in (q, k, v))
    aux = {n: t.to(cuda, index) for n, t in aux.items()}
    if step > 1:                               # every step-th column of a wider table: pages not adjacent
        wide = torch.full((op.batch, op.max_pages * step), -1, dtype=torch.int32, device=cuda)
        wide[:, ::step] = aux["block_table"]
        aux["block_table"] = wide[:, ::step]
        assert aux["block_table"].stride(1) == step
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=q.dtype, device=cuda)
    lse = torch.full(s["lse"], float("nan"), device=cuda)
    cfg = C.AttnConfig(16, 64, 4, stages, pack=op.group_size, num_splits=splits, decode_ws=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback: this must run the Gluon kernel
        F.build(op, dev, cfg)(q, k, v, out, lse, aux)
    torch.cuda.synchronize()
    err = np.abs(out.double().cpu().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g}"
    assert np.abs(lse.double().cpu().numpy() - ref_lse).max() <= LSE_ATOL


def _replay_matches_reference(graph, op, out, lse, inputs):
    """Replay ``graph`` and compare ``out`` / ``lse`` with the float64 reference of the CPU ``inputs``."""
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(op, *inputs)
    assert np.abs(out.double().cpu().numpy() - ref_out).max() <= ATOL[op.dtype]
    assert np.abs(lse.double().cpu().numpy() - ref_lse).max() <= LSE_ATOL


def _table_kernel(op, **changes):
    """The sm_90 GPU, its torch device and the table's split Gluon decode kernel for ``op`` with ``changes`` to its
    configuration."""
    from portakern.backends.triton.attention import forward as F, plan

    dev = _gpu()
    cfg = replace(plan.choose(op, *plan.family(dev)), **changes)
    assert cfg.decode_ws and cfg.num_splits > 1
    return dev, torch.device(str(dev)), F.build(op, dev, cfg)


def _to_device(op, inputs, cuda):
    """``_inputs``' CPU q, K, V and index arrays on ``cuda``, with empty output and LSE tensors."""
    *qkv, aux = inputs
    q, k, v = (t.to(cuda) for t in qkv)
    s = op.shapes()
    return (q, k, v, {n: t.to(cuda) for n, t in aux.items()}, torch.empty(s["out"], dtype=q.dtype, device=cuda),
            torch.empty(s["lse"], device=cuda))


def _copy_inputs(new, q, k, v, aux):
    """Copy the CPU inputs ``new`` (``_inputs``) into the device tensors a captured graph reads."""
    nq, nk, nv, naux = new
    for dst, src in ((q, nq), (k, nk), (v, nv), (aux["block_table"], naux["block_table"]),
                     (aux["seqlens_k"], naux["seqlens_k"])):
        dst.copy_(src.to(dst.device))


@needs_compiler
def test_gpu_table_kernel_replays_in_a_cuda_graph_with_new_inputs():
    """The table's configuration (Gluon decode + attn_combine) captured once, replayed after the inputs and
    the lengths change in place: the second replay matches the reference of the new values."""
    op = paged(L=4096, page=16, return_lse=True)
    dev, cuda, kern = _table_kernel(op)
    q, k, v, aux, out, lse = _to_device(op, _inputs(op, [4096], seed=1), cuda)
    kern(q, k, v, out, lse, aux)                                  # warm: compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(q, k, v, out, lse, aux)
    new = _inputs(op, [2500], seed=2)
    _copy_inputs(new, q, k, v, aux)
    out.fill_(float("nan"))
    _replay_matches_reference(graph, op, out, lse, new)


@needs_compiler
def test_gpu_pdl_launch_reads_what_the_kernel_before_it_wrote():
    """With ``pdl`` the kernel may start while the previous kernel runs: captured in a CUDA graph behind
    kernels that write its query, K and V (each an element-wise kernel over the whole tensor) into buffers
    that hold NaN before the replay, it must see only the new values."""
    op = paged(L=4096, page=16, return_lse=True)
    dev, cuda, kern = _table_kernel(op, pdl=True)
    new = _inputs(op, [3001], seed=3)
    *src, aux, out, lse = _to_device(op, new, cuda)
    q, k, v = (torch.empty_like(t) for t in src)

    def step():
        for dst, t in zip((q, k, v), src):
            torch.mul(t, 1.0, out=dst)
        kern(q, k, v, out, lse, aux)

    step()                                                       # warm: compile, workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (q, k, v, out, lse):
        t.fill_(float("nan"))
    _replay_matches_reference(graph, op, out, lse, new)


@needs_compiler
@pytest.mark.parametrize("changes", [{"release_next": True}, {"release_next": True, "early_merge": True},
                                     {"release_next": True, "early_merge": True, "pdl": True}],
                         ids=["release", "early", "early-pdl"])
def test_gpu_released_merge_lets_a_dependent_gemv_read_the_merged_output(changes):
    """With ``release_next`` the merge lets the next kernel launch at its start (``early_merge``: while the decode
    kernel still runs): a quantized GEMV launched as a programmatic dependent (the table's M=1 kernel, ``pdl``)
    behind it in a CUDA graph, fed the attention output as x (poisoned with NaN before the replay), must read
    the finished output: float64 reference of ``attention(q, K, V) @ W^T`` from new inputs."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.ir.packing import dequantize
    from portakern.quantize import quantize
    from portakern.validate import quant_gemv_op

    op = paged(L=2048, page=64, return_lse=True)
    dev, cuda, attend = _table_kernel(op, **changes)
    K = op.heads_q * op.head_dim
    w = quantize(np.random.default_rng(5).standard_normal((1024, K)), bits=4, group_size=128)
    wd = w.with_tensors({n: torch.as_tensor(t).to(cuda) for n, t in w.tensors.items()})
    x0 = torch.zeros(1, K, device=cuda, dtype=torch.bfloat16)
    gop, _ = quant_gemv_op(x0, wd)
    gemv = Q.compile(gop, dev)
    prepared = prepare_gemv_weight(w, dev)
    q, k, v, aux, out, lse = _to_device(op, _inputs(op, [2048], seed=4), cuda)
    y = torch.empty(1, 1024, device=cuda, dtype=torch.bfloat16)

    def step():
        attend(q, k, v, out, lse, aux)
        gemv(out.view(1, K), prepared, y)

    step()                                                       # warm: compile, workspaces
    torch.cuda.synchronize()
    assert next(iter(gemv.launchers.values())).cfg.pdl          # the GEMV is launched as a dependent
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new = _inputs(op, [1777], seed=6)
    _copy_inputs(new, q, k, v, aux)
    for t in (out, lse, y):
        t.fill_(float("nan"))
    _replay_matches_reference(graph, op, out, lse, new)
    ref = out.double().cpu().reshape(1, K) @ torch.from_numpy(dequantize(w.fmt, w.tensors, w.N, w.K)).double().T
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"GEMV of the merged output: relative error {err:.3g}"


@needs_compiler
def test_gpu_falls_back_to_attn_fwd_for_k_without_a_row_major_view():
    from portakern.backends.triton.attention import forward as F, plan

    dev = _gpu()
    op = paged(L=1024, page=16, return_lse=False)
    cuda = torch.device(str(dev))
    q, k, v, aux = _inputs(op, [1000], seed=3)
    ref_out, _ = _reference(op, q, k, v, aux)
    wide = torch.zeros(*k.shape[:3], 136, dtype=k.dtype, device=cuda)
    wide[..., :128] = k.to(cuda)
    kv = wide[..., :128]                       # heads 136 elements apart: no (rows, HKV * D) view
    out = torch.full(op.shapes()["out"], float("nan"), dtype=q.dtype, device=cuda)
    kern = F.build(op, dev, plan.choose(op, *plan.family(dev)))
    assert kern.config.decode_ws
    with pytest.warns(RuntimeWarning, match=r"runs attn_fwd instead of the Gluon decode kernel for this call: "
                                            r"k with strides \(17408, 1088, 136, 1\) has no \(rows, HKV \* D\) view"):
        kern(q.to(cuda), kv, v.to(cuda), out, None, {n: t.to(cuda) for n, t in aux.items()})
    torch.cuda.synchronize()
    assert np.abs(out.double().cpu().numpy() - ref_out).max() <= ATOL[op.dtype]


@needs_compiler
def test_gpu_table_kernel_called_again_on_new_tensors(monkeypatch):
    """The table's decode kernel and merge called three times on new tensors (new values, lengths and block
    table; outputs poisoned): the second and third calls launch both kernels straight through their compiled
    launchers and match the float64 reference."""
    from portakern.backends.triton.common.launch import KernelLaunch

    verdicts, guard = [], KernelLaunch._guard

    def logged(self, fast, args):
        verdicts.append(guard(self, fast, args))
        return verdicts[-1]

    monkeypatch.setattr(KernelLaunch, "_guard", logged)
    op = paged(L=2048, page=64, return_lse=True)
    dev, cuda, kern = _table_kernel(op)
    for call, lens in enumerate([[2048], [1500], [77]]):
        inputs = _inputs(op, lens, seed=10 + call)
        q, k, v, aux, out, lse = _to_device(op, inputs, cuda)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        kern(q, k, v, out, lse, aux)
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(op, *inputs)
        assert np.abs(out.double().cpu().numpy() - ref_out).max() <= ATOL[op.dtype], f"call {call}"
        assert np.abs(lse.double().cpu().numpy() - ref_lse).max() <= LSE_ATOL, f"call {call}"
    assert verdicts == [True, True, True, True], verdicts   # decode and merge, calls 1 and 2
