"""TMA loads of K and V in ``attn_fwd`` (``AttnConfig.tma``).

Interpreter tests (Triton's interpreter runs tensor-descriptor loads, zero fill included) check
the numbers against the float64 cpu kernel, in a child process with ``TRITON_INTERPRET=1`` as in
``test_triton_attention.py``; a compile-only test checks the sm_90a lowering (``cp.async.bulk.tensor``);
the rest checks the refusals, ``fit`` and the table. (The warp-specialised prefill is the Gluon kernel,
``test_triton_attention_wgmma.py``; Triton's own warp-specialised walk of ``attn_fwd`` faulted on the
H200 and is not used.)
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from portakern.devices import CPU  # noqa: E402
from portakern.ir import DType, KVLayout  # noqa: E402
from portakern.ir import expr as E  # noqa: E402
from triton_helpers import _cache_dir  # noqa: E402,F401  (the module's expression cache)
from triton_helpers import ATOL, LSE_ATOL, TORCH_DTYPE, make_op, needs_compiler, run_reference, tensors  # noqa: E402


def run_config(op, q, k, v, aux=None, **cfg_kw):
    """Launch ``op`` on the interpreter under its table config with ``cfg_kw`` replaced, check it
    against float64; returns the pointer-fallback warnings."""
    from portakern.backends.triton.attention import forward as F, plan

    cfg = replace(plan.for_device(op, CPU), **cfg_kw)
    s = op.shapes()
    out = torch.full(s["out"], float("nan"), dtype=TORCH_DTYPE[op.dtype])
    lse = torch.full(s["lse"], float("nan")) if op.return_lse else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.build(op, CPU, cfg)(q, k, v, out, lse, dict(aux or {}))
    ref_out, ref_lse = run_reference(op, q, k, v, aux)
    err = np.abs(out.double().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g}"
    if lse is not None:
        got = lse.double().numpy()
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(got), fin)
        assert np.abs(got[fin] - ref_lse[fin]).max() <= LSE_ATOL
    return [str(w.message) for w in caught if "runs pointer loads" in str(w.message)]


# -- interpreter: TMA loads -------------------------------------------------------------------------

TMA_CASES = {
    # name: (make_op kwargs, expect the pointer fallback)
    "tail-gqa-causal-d40": (dict(B=2, Sq=45, Sk=61, Hq=4, Hkv=2, D=40, mask_mod=E.causal_mask()), False),
    "window-bf16": (dict(B=1, Sq=40, Sk=53, Hq=2, Hkv=1, D=64, dtype=DType.bfloat16,
                         mask_mod=E.window_mask(9, 4)), False),
    "custom-mask-fp32": (dict(B=2, Sq=20, Sk=35, Hq=2, Hkv=2, D=32, dtype=DType.float32,
                              score_mod=E.softcap_score(2.0), mask_mod=E.prefix_lm_mask(7)), False),
    "d59-fallback": (dict(B=1, Sq=20, Sk=35, Hq=2, Hkv=1, D=59, mask_mod=E.causal_mask()), True),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(TMA_CASES), ids=str)
def test_tma_matches_the_reference(case):
    """TMA K/V tiles: tail tiles past Sk and columns past D come back zero-filled; D=59 fp16 rows
    (118 bytes) break TMA's 16-byte stride rule, so that call runs the pointer kernel and says so."""
    kw, fallback = TMA_CASES[case]
    op = make_op(**kw)
    warned = run_config(op, *tensors(op, seed=2), tma=True)
    assert bool(warned) is fallback, warned
    if fallback:
        assert "stride" in warned[0] and "16 bytes" in warned[0]


@pytest.mark.interpreter
def test_tma_strided_inputs_and_unaligned_views():
    """Strided K/V views (packed K|V, offset columns) go through TMA when 16-byte aligned; a view that
    starts 2 bytes in falls back to the pointer kernel with the same results."""
    op = make_op(B=2, Sq=17, Sk=29, Hq=4, Hkv=2, D=32, mask_mod=E.causal_mask())
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 17, 32, generator=g).half().transpose(1, 2)
    kv = torch.randn(2, 29, 2, 2, 48, generator=g).half()
    k, v = kv[:, :, :, 0, :32], kv[:, :, :, 1, 8:40]
    assert run_config(op, q, k, v, tma=True) == []
    k_odd = kv[:, :, :, 0, 1:33]
    warned = run_config(op, q, k_odd, v, tma=True)
    assert len(warned) == 1 and "not 16-byte aligned" in warned[0]


@pytest.mark.interpreter
def test_tma_seqlens_k_ignores_values_past_each_length():
    """Rows past a sequence's seqlens_k lie inside the tensor, so TMA reads them: NaN there must not
    reach the output (scores masked, V rows zeroed)."""
    op = make_op(B=3, Sq=40, Sk=50, Hq=2, Hkv=1, D=32, has_seqlens_k=True, mask_mod=E.causal_mask())
    q, k, v = tensors(op, seed=7)
    lens = torch.tensor([50, 0, 23], dtype=torch.int32)
    k[2, 23:], v[2, 23:] = float("nan"), float("nan")
    k[1], v[1] = float("nan"), float("nan")
    assert run_config(op, q, k, v, {"seqlens_k": lens}, tma=True) == []


# -- lowering for sm_90a (no GPU) ------------------------------------------------------------------------

def _lower(op, **cfg_kw):
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import plan

    cfg = replace(plan.choose(op, "sm_90", 132, wgmma=False), **cfg_kw)
    art = A.compile_for_target(op, "sm_90a", cfg)
    assert art["config"] == cfg.to_json()
    return art["kernels"]["attn_fwd"]


@needs_compiler
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lowering_tma_sm90a(causal):
    """tma=True lowers K/V loads to cp.async.bulk.tensor; the default kernel has none."""
    op = make_op(B=2, Sq=1024, Sk=1024, Hq=8, Hkv=2, D=128, dtype=DType.bfloat16, return_lse=False,
                 mask_mod=E.causal_mask() if causal else None)
    assert "cp.async.bulk.tensor" not in _lower(op)["ptx"]
    assert "cp.async.bulk.tensor" in _lower(op, tma=True)["ptx"]


# -- refusals, fit, candidates ---------------------------------------------------------------------------

PREFILL = dict(B=2, Sq=1024, Sk=1024, Hq=8, Hkv=2, D=128, dtype=DType.bfloat16)


def test_tma_is_refused_on_sm80():
    from portakern.backends.triton.attention import plan, rules as R

    op = make_op(**PREFILL)
    cfg = replace(plan.choose(op, "sm_80", 132), tma=True)
    with pytest.raises(ValueError, match=r"AttnConfig\(tma=True\) on sm_80: .*sm_90.*use tma=False"):
        R.check_tma(op, cfg, "sm_80")


def test_tma_is_refused_for_paged_and_packed_ops_and_fit_clears_it():
    from portakern.backends.triton import attention as A
    from portakern.backends.triton.attention import config as C, forward as F, plan, rules as R

    paged = make_op(B=1, Sq=1, Sk=256, Hq=8, Hkv=2, D=64, kv_layout=KVLayout.PAGED, page_size=16, num_pages=20,
                    has_seqlens_k=True)
    cfg = replace(plan.for_device(paged, CPU), tma=True)
    with pytest.raises(ValueError, match=r"tma=True\) for paged attention with pack=4 and seqlen_k=256: .*dense keys"):
        F.build(paged, CPU, cfg)
    with pytest.raises(ValueError, match=r"tma=True\) on sm_80"):
        A.compile_for_target(make_op(**PREFILL), "sm_80", C.AttnConfig(128, 64, 8, 2, tma=True))
    assert plan.fit(paged, cfg, "sm_90") == replace(cfg, tma=False)
    assert not plan.fit(make_op(**PREFILL), C.AttnConfig(128, 64, 8, 2, tma=True), "sm_80").tma
    # one key: Triton specialises seqlen_k == 1 to a constant, and that TMA kernel crashes ptxas 3.6
    one_key = make_op(B=1, Sq=239, Sk=1, Hq=4, Hkv=1, D=256, dtype=DType.bfloat16)
    dense = C.AttnConfig(128, 64, 8, 2, tma=True)
    with pytest.raises(ValueError, match=r"tma=True\) for dense attention with pack=1 and seqlen_k=1: .*more than "
                                         r"one key; use tma=False"):
        R.check_tma(one_key, dense, "sm_90")
    assert not plan.fit(one_key, dense, "sm_90").tma
    assert not plan.choose(one_key, "sm_90", 132).tma
    two_keys = make_op(B=1, Sq=239, Sk=2, Hq=4, Hkv=1, D=256, dtype=DType.bfloat16)
    assert plan.choose(two_keys, "sm_90", 132, wgmma=False).tma       # attn_fwd's tile (its fallback)
    assert plan.choose(two_keys, "sm_90", 132).wgmma                  # the table: the Gluon kernel


def test_config_round_trips_and_the_table_and_autotuning_offer_tma(monkeypatch):
    """tma round-trips through JSON; the sm_90 table (``tuning.TMA_PREFILL``) gives attn_fwd TMA for dense
    fp16/bf16 prefill with D > 128 in whole 16-byte rows and more than one key (the table runs D=256 on the
    Gluon kernel, and attn_fwd's TMA tile is its fallback and serves D=200, masks and score_mods), no
    other table does; autotuning times TMA both ways where it applies."""
    from portakern.backends.triton import tuning
    from portakern.backends.triton.attention import autotune as AT, config as C, plan, rules as R

    cfg = C.AttnConfig(64, 128, 4, 2, tma=True)
    assert C.AttnConfig(**cfg.to_json()) == cfg
    for D, want in ((64, False), (128, False), (256, True), (200, True), (130, False)):
        op = make_op(B=2, Sq=512, Sk=512, Hq=4, Hkv=2, D=D, dtype=DType.bfloat16, mask_mod=E.causal_mask())
        assert tuple(tuning.TMA_PREFILL) == ("sm_90",)
        assert plan.choose(op, "sm_90", 132, wgmma=False).tma is want, D
        assert plan.choose(op, "sm_90", 132).wgmma is (D in (128, 256)), D
        assert not plan.choose(make_op(B=2, Sq=512, Sk=512, Hq=4, Hkv=2, D=D, dtype=DType.float32),
                                 "sm_90", 132).tma
        with monkeypatch.context() as mp:
            mp.setattr(tuning, "TMA_PREFILL", {})
            assert not plan.choose(op, "sm_90", 132, wgmma=False).tma
        for arch, sms in (("sm_80", 108), ("sm_100", 148), ("interp", 4)):
            assert not plan.choose(op, arch, sms).tma
        cands = AT.candidates(op, "sm_90", 132)
        assert {c.tma for c in cands} == {False, True}
        for c in cands:
            R.check_tma(op, c, "sm_90")
        assert not any(c.tma for c in AT.candidates(op, "sm_80", 108))
    dec = make_op(B=1, Sq=1, Sk=32768, Hq=32, Hkv=8, D=256, dtype=DType.bfloat16)
    assert not plan.choose(dec, "sm_90", 132).tma
    assert not any(c.tma for c in AT.candidates(dec, "sm_90", 132))


# -- on a CUDA device (sm_90+) --------------------------------------------------------------------------

@needs_compiler
@pytest.mark.parametrize("D,causal", [(128, False), (64, True), (256, False), (256, True)])
def test_gpu_tma_matches_the_reference(D, causal):
    """On a CUDA device (sm_90+): tma=True on attn_fwd's table tile (real TMA zero fill, Sq not a
    multiple of the tile), output poisoned first, against float64."""
    from portakern.backends.triton.attention import forward as F, plan
    from portakern.devices import detect_devices

    devs = [d for d in detect_devices() if d.type == "cuda"]
    if not devs:
        pytest.skip("no CUDA device on this machine: the interpreter tests above run the TMA kernels")
    dev = devs[0]
    if tuple(dev.capability) < (9, 0):
        pytest.skip(f"TMA needs sm_90+, this device is {dev.arch}")
    op = make_op(B=2, Sq=384, Sk=512, Hq=4, Hkv=2, D=D, dtype=DType.bfloat16, return_lse=False,
                 mask_mod=E.causal_mask() if causal else None)
    arch, sms = plan.family(dev)
    cfg = replace(plan.choose(op, arch, sms, wgmma=False), tma=True)
    cuda = torch.device(str(dev))
    q, k, v = tensors(op, seed=3)
    ref_out, _ = run_reference(op, q, k, v)
    q, k, v = (t.to(cuda) for t in (q, k, v))
    out = torch.full(op.shapes()["out"], float("nan"), dtype=torch.bfloat16, device=cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a pointer fallback here would not test TMA
        F.build(op, dev, cfg)(q, k, v, out, None, {})
    torch.cuda.synchronize()
    err = np.abs(out.double().cpu().numpy() - ref_out).max()
    assert err <= ATOL[op.dtype], f"max |out - ref| = {err:.3g}"
