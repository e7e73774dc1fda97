"""The triton attention backend under Triton's CPU interpreter, against the float64 references.

Triton decides at import whether ``@triton.jit`` interprets, so these tests need
``TRITON_INTERPRET=1`` before triton is first imported. When this process was not started that
way, ``test_interpreter_suite`` runs this file again in a child process that is (nothing here
changes the environment of the calling process). References: the cpu backend's kernel (float64)
and torch SDPA in float64 with masks built from ``torch.arange``. Outputs are NaN-poisoned
before each launch, so an element the kernel does not write fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from portakern.backends.cpu.attention import attention_kernel  # noqa: E402
from portakern.devices import CPU  # noqa: E402
from portakern.ir import Attention, DType, KVLayout  # noqa: E402
from portakern.ir import expr as E  # noqa: E402


def _interpreter_ready() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    if "triton" in sys.modules:
        import triton.language as tl

        return type(tl.standard.cdiv).__name__ == "InterpretedFunction"
    return True


IN_PROCESS = _interpreter_ready()
interp = pytest.mark.skipif(not IN_PROCESS, reason="needs TRITON_INTERPRET=1 before triton's import: "
                                                   "test_interpreter_suite runs these in a child process")

parent_only = pytest.mark.skipif(os.environ.get("PORTAKERN_TRITON_TEST_CHILD") == "1",
                                 reason="needs no interpreter: runs in the parent process")

TORCH_DTYPE = {DType.float16: torch.float16, DType.bfloat16: torch.bfloat16, DType.float32: torch.float32}
#: max |triton - float64 reference| on outputs of O(1); LSE gets the fp32 figure
ATOL = {DType.float32: 2e-5, DType.float16: 3e-3, DType.bfloat16: 2.5e-2}
LSE_ATOL = 2e-4


def run_interpreter_child(test_file: str) -> None:
    """Run ``test_file``'s interpreter tests in a child with TRITON_INTERPRET=1 set before any import."""
    env = dict(os.environ, TRITON_INTERPRET="1", PORTAKERN_TRITON_TEST_CHILD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout[-8000:] + proc.stderr[-3000:])


@pytest.mark.skipif(IN_PROCESS, reason="already running under the interpreter")
def test_interpreter_suite():
    """Run this file's interpreter tests in a child process (``run_interpreter_child``)."""
    run_interpreter_child(__file__)


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    """Generated expression modules go to a temporary cache for this module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORTAKERN_CACHE_DIR", str(tmp_path_factory.mktemp("portakern-cache")))
        yield


# -- helpers --------------------------------------------------------------------------------------

def make_op(B=1, Sq=8, Sk=8, Hq=2, Hkv=2, D=32, Dv=None, dtype=DType.float16, **kw) -> Attention:
    kw.setdefault("scale", 1.0 / math.sqrt(D))
    return Attention(batch=B, seqlen_q=Sq, seqlen_k=Sk, heads_q=Hq, heads_kv=Hkv, head_dim=D,
                     head_dim_v=Dv or D, dtype=dtype, return_lse=kw.pop("return_lse", True), **kw).verify()


def tensors(op: Attention, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, dt = op.shapes(), TORCH_DTYPE[op.dtype]
    return tuple(torch.randn(s[n], generator=g).to(dt) for n in ("q", "k", "v"))


def run_triton(op: Attention, q, k, v, aux=None):
    """Compile for the CPU (interpreter) and launch on NaN-poisoned outputs."""
    from portakern.backends.triton.backend import TritonBackend

    be = TritonBackend()
    assert be.supports(op, CPU), be.supports(op, CPU).reason
    kern = be.compile(op, CPU)
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=TORCH_DTYPE[op.dtype])
    lse = torch.full(s["lse"], float("nan"), dtype=torch.float32) if op.return_lse else None
    kern(q, k, v, out, lse, dict(aux or {}))
    assert not torch.isnan(out).any(), "out has NaN: an element was left unwritten or the math broke"
    if lse is not None:
        assert not torch.isnan(lse).any(), "lse has NaN: an element was left unwritten"
    return out, lse, kern


def sm90_device(what: str):
    """The first CUDA device, for tests of ``what`` (a Gluon kernel for sm_90): skipped without one, or when
    it is not sm_90 (the lowering tests cover the kernel off the GPU)."""
    from portakern.devices import detect_devices

    devs = [d for d in detect_devices() if d.type == "cuda"]
    if not devs:
        pytest.skip(f"no CUDA device on this machine: the lowering tests cover {what} off the GPU")
    if tuple(devs[0].capability) != (9, 0):
        pytest.skip(f"{what} runs on sm_90, this device is {devs[0].arch}")
    return devs[0]


def run_reference(op: Attention, q, k, v, aux=None):
    """The cpu backend's float64 kernel on the same values."""
    s = op.shapes()
    out = np.zeros(s["out"], dtype=np.float64)
    lse = np.zeros(s["lse"], dtype=np.float64) if op.return_lse else None
    np_aux = {n: (None if a is None else a.numpy()) for n, a in (aux or {}).items()}
    attention_kernel(op)(*(t.double().numpy() for t in (q, k, v)), out, lse, np_aux)
    return out, lse


def check(op: Attention, q, k, v, aux=None):
    out, lse, kern = run_triton(op, q, k, v, aux)
    ref_out, ref_lse = run_reference(op, q, k, v, aux)
    err = np.abs(out.double().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g} > {ATOL[op.dtype]}"
    if lse is not None:
        got = lse.double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse)), "lse is -inf on different rows"
        fin = np.isfinite(ref_lse)
        if fin.any():
            lerr = np.abs(got[fin] - ref_lse[fin]).max()
            assert lerr <= LSE_ATOL, f"max |lse - ref| = {lerr:.3g}"
    return out, lse, kern


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


@interp
@pytest.mark.parametrize("dtype", [DType.float16, DType.bfloat16, DType.float32], ids=lambda d: d.value)
@pytest.mark.parametrize("variant", list(VARIANTS), ids=str)
def test_dense_variants(dtype, variant):
    op = make_op(B=2, Sq=45, Sk=61, Hq=4, Hkv=2, D=40, dtype=dtype, **VARIANTS[variant])
    check(op, *tensors(op))


@interp
@pytest.mark.parametrize("D,Dv", [(32, 32), (59, 59), (96, 96), (111, 111), (128, 128), (256, 256), (64, 48)],
                         ids=lambda x: str(x))
def test_head_dims(D, Dv):
    op = make_op(B=1, Sq=20, Sk=35, Hq=2, Hkv=1, D=D, Dv=Dv, mask_mod=E.causal_mask())
    check(op, *tensors(op))


@interp
def test_more_queries_than_keys_gives_zero_rows_and_neg_inf_lse():
    op = make_op(B=1, Sq=40, Sk=9, Hq=2, Hkv=2, D=32, mask_mod=E.causal_mask())
    out, lse, _ = check(op, *tensors(op))
    # query i sees keys j <= i + 9 - 40: rows 0..30 see nothing
    assert torch.all(out[0, :31] == 0) and torch.all(torch.isneginf(lse[0, :, :31]))
    assert torch.isfinite(lse[0, :, 31:]).all()


@interp
def test_mask_that_hides_everything():
    op = make_op(B=1, Sq=5, Sk=30, Hq=2, Hkv=1, D=32, mask_mod=E.kv_idx < 0)
    out, lse, _ = run_triton(op, *tensors(op))
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@interp
@pytest.mark.parametrize("causal", [False, True])
def test_against_torch_sdpa_float64(causal):
    """Independent reference: torch SDPA in float64, bottom-right mask from torch.arange."""
    op = make_op(B=2, Sq=33, Sk=50, Hq=6, Hkv=2, D=48, dtype=DType.float32, return_lse=False,
                 mask_mod=E.causal_mask() if causal else None)
    q, k, v = tensors(op, seed=3)
    out, _, _ = run_triton(op, q, k, v)
    G = op.group_size
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    mask = None
    if causal:
        mask = torch.arange(op.seqlen_k)[None, :] <= torch.arange(op.seqlen_q)[:, None] + op.seqlen_k - op.seqlen_q
    ref = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).transpose(1, 2)
    assert (out.double() - ref).abs().max() < 2e-5


@interp
def test_non_contiguous_inputs():
    op = make_op(B=2, Sq=17, Sk=29, Hq=4, Hkv=2, D=32, mask_mod=E.causal_mask())
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 17, 32, generator=g).half().transpose(1, 2)          # BHSD storage
    kv = torch.randn(2, 29, 2, 2, 48, generator=g).half()                       # packed K|V, padded D
    k, v = kv[:, :, :, 0, :32], kv[:, :, :, 1, 8:40]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check(op, q, k, v)


@interp
def test_seqlens_k_dense():
    op = make_op(B=3, Sq=6, Sk=50, Hq=4, Hkv=1, D=32, has_seqlens_k=True, mask_mod=E.causal_mask())
    aux = {"seqlens_k": torch.tensor([50, 0, 23], dtype=torch.int32)}
    out, lse, _ = check(op, *tensors(op), aux)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))


# -- decode: split-KV, GQA packing ------------------------------------------------------------------

@interp
@pytest.mark.parametrize("dtype", [DType.float16, DType.bfloat16], ids=lambda d: d.value)
@pytest.mark.parametrize("Sq,Hq,Hkv", [(1, 8, 2), (1, 6, 1), (4, 8, 2), (1, 2, 2)], ids=str)
def test_decode_split_kv(dtype, Sq, Hq, Hkv):
    op = make_op(B=2, Sq=Sq, Sk=300, Hq=Hq, Hkv=Hkv, D=64, dtype=dtype, mask_mod=E.causal_mask())
    _, _, kern = check(op, *tensors(op))
    assert kern.config.num_splits > 1 and kern.config.pack == Hq // Hkv
    tiles = -(-Sq // (kern.config.block_m // kern.config.pack)) * 2 * Hkv
    assert kern.workspace_bytes == 4 * kern.config.num_splits * 2 * Sq * Hq * (64 + 1) + 4 * tiles


@interp
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


@interp
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


@interp
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

@interp
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


@interp
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

@interp
def test_public_api_bf16_matches_cpu_backend():
    import portakern

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 4, 64, generator=g).bfloat16()
    k = torch.randn(1, 31, 1, 64, generator=g).bfloat16()
    v = torch.randn(1, 31, 1, 64, generator=g).bfloat16()
    out, lse = portakern.attention(q, k, v, causal=True, softcap=4.0, return_lse=True, backend="triton")
    ref, ref_lse = portakern.attention(q, k, v, causal=True, softcap=4.0, return_lse=True, backend="cpu")
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() < 2e-2
    assert (lse - ref_lse).abs().max() < 1e-3


@parent_only
def test_supports_gives_reasons():
    from portakern.backends.triton import attention as A

    op = make_op(D=320)
    s = A.supports(op, CPU)
    assert not s and "head_dim=320" in s.reason and "backend=\"cpu\"" in s.reason


@parent_only
def test_mask_analysis_recognises_library_masks():
    from portakern.backends.triton.expr_triton import analyse_mask

    assert analyse_mask(E.causal_mask()).right == 0 and analyse_mask(E.causal_mask()).left is None
    w = analyse_mask(E.window_mask(5, 3))
    assert (w.left, w.right, w.residual) == (5, 3, False)
    cw = analyse_mask(E.causal_mask() & E.window_mask(7, 2) & E.window_mask(4, -1))
    assert (cw.left, cw.right, cw.residual) == (4, 0, False)
    assert analyse_mask(E.prefix_lm_mask(3)).residual
    assert analyse_mask(E.causal_mask() & (E.kv_idx > 2)) == type(w)(None, 0, True, False)


@parent_only
def test_generated_source_types():
    from portakern.backends.triton.expr_triton import generate_source

    src = generate_source(E.where(E.q_idx > 3, E.score, 1) + (E.kv_idx < 2), ~(E.kv_idx.eq(E.h)))
    assert "def score_mod" in src and "def mask_mod" in src and ".to(tl.int32)" in src
    assert "_INF" in generate_source(E.where(E.kv_idx > 0, E.score, float("-inf")), None)


@parent_only
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


@parent_only
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


@parent_only
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


@parent_only
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


@interp
@pytest.mark.parametrize("scale", [0.8, -0.8], ids=["positive-scale", "negative-scale"])
def test_both_softmax_paths_match_the_reference(scale):
    """A positive scale without score_mod takes the row maximum on the raw scores (``RAW_MAX``: one FFMA per
    score for the exponent); a negative one reverses the order of the scores and takes the scaled path.
    Both against float64, causal with a partial last tile so the masked walk runs too."""
    op = make_op(B=2, Sq=37, Sk=53, Hq=4, Hkv=2, D=32, scale=scale, mask_mod=E.causal_mask())
    check(op, *tensors(op, seed=5))


@interp
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
