"""The optional vendor backends ``fa4`` (FlashAttention-4, ``flash_attn.cute``) and ``flashinfer``.

Neither package installs on a CPU machine, so each is replaced here by a fake module (put in ``sys.modules``) that
records every call and computes FlashAttention's / FlashInfer's documented semantics in float64 -- bottom-right
causal and windows, a logit softcap, grouped heads, ``seqused_k`` / page tables / ``cu_seqlens``, and each library's
marks for a row with no visible key (FA4: LSE ``+inf``; FlashInfer: NaN output, base-2 LSE). The backends' kernels run
on CPU tensors against the fake and must agree with the cpu reference backend; ``supports`` is asked with a fake
GPU device. The real packages run on the lent GPU: ``portakern conformance --backend fa4 --device cuda:0``.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import portakern
from portakern.devices import Device
from portakern.ir import Attention, DType, QuantFormat, QuantGemv
from portakern.ir import expr as E
from portakern.plugins import registry

H100 = Device("cuda", 0, "sm_90", capability=(9, 0))
B200 = Device("cuda", 0, "sm_100", capability=(10, 0))


def _one(q, k, v, scale, left, right, cap):
    """FlashAttention semantics for one sequence, float64: q (Sq, H, D), k / v (Sk, Hkv, .) -> out, lse (H, Sq)."""
    Sq, H, Sk = q.shape[0], q.shape[1], k.shape[0]
    G = H // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("ihd,jhd->hij", qd, kd) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    diag = torch.arange(Sq)[:, None] + Sk - Sq
    j = torch.arange(Sk)[None, :]
    keep = torch.ones(Sq, Sk, dtype=torch.bool)
    if left is not None:
        keep &= j >= diag - left
    if right is not None:
        keep &= j <= diag + right
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, vd), lse


class FakeFA4(types.ModuleType):
    """``flash_attn.cute``: ``flash_attn_func`` / ``flash_attn_varlen_func`` with FA4's signature."""

    def __init__(self):
        super().__init__("flash_attn.cute")
        self.calls = []

    def _flags(self, causal, window_size):
        left, right = window_size
        return (None, 0) if causal else (left, right)

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                        return_lse=False, **rest):
        self.calls.append(("dense", dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap, return_lse=return_lse, **rest)))
        left, right = self._flags(causal, window_size)
        outs = [_one(q[b], k[b], v[b], softmax_scale, left, right, softcap) for b in range(q.shape[0])]
        return self._finish(torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs]), q.dtype, return_lse)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), softcap=0.0, return_lse=False, **rest):
        self.calls.append(("varlen", dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                          seqused_k=seqused_k, page_table=page_table, causal=causal,
                                          window_size=window_size, softcap=softcap, return_lse=return_lse)))
        for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table):
            assert t is None or t.dtype == torch.int32, "FA4 takes int32 index tensors"
        left, right = self._flags(causal, window_size)
        if cu_seqlens_q is not None:
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            outs = [_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], softmax_scale, left, right,
                         softcap) for b in range(len(cq) - 1)]
            return self._finish(torch.cat([o for o, _ in outs]), torch.cat([l for _, l in outs], 1), q.dtype,
                                return_lse)
        outs = []
        for b in range(q.shape[0]):
            L = int(seqused_k[b])
            if page_table is not None:
                kb = k[page_table[b].long()].flatten(0, 1)[:L]
                vb = v[page_table[b].long()].flatten(0, 1)[:L]
            else:
                kb, vb = k[b, :L], v[b, :L]
            outs.append(_one(q[b], kb, vb, softmax_scale, left, right, softcap))
        return self._finish(torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs]), q.dtype, return_lse)

    @staticmethod
    def _finish(out, lse, dtype, return_lse):
        lse = lse.float().masked_fill(lse == -math.inf, math.inf)       # FA's mark of a row with no visible key
        return out.to(dtype), (lse if return_lse else None)


class FakeFlashInfer(types.ModuleType):
    """``flashinfer.single_prefill_with_kv_cache`` (NHD): base-2 LSE (qo_len, H), NaN rows where no key is seen."""

    def __init__(self):
        super().__init__("flashinfer")
        self.calls = []

    def single_prefill_with_kv_cache(self, q, k, v, causal=False, kv_layout="NHD", window_left=-1,
                                     logits_soft_cap=None, sm_scale=None, return_lse=False, **rest):
        self.calls.append(dict(causal=causal, kv_layout=kv_layout, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, return_lse=return_lse,
                               shapes=(tuple(q.shape), tuple(k.shape))))
        assert kv_layout == "NHD"
        out, lse = _one(q, k, v, sm_scale, None if window_left < 0 else window_left, 0 if causal else None,
                        logits_soft_cap or 0.0)
        out = out.masked_fill((lse == -math.inf).T[..., None], math.nan).to(q.dtype)
        return (out, (lse / math.log(2.0)).T.float()) if return_lse else out


@pytest.fixture
def fa4(monkeypatch):
    fake = FakeFA4()
    pkg = types.ModuleType("flash_attn")
    pkg.cute = fake
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    return fake


@pytest.fixture
def flashinfer(monkeypatch):
    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return fake


def _run(name, device, q, k, v, *, ref_kw):
    """Compile ``name``'s kernel for the op the cpu reference dispatches for these arrays, run it on the CPU tensors
    and compare with the cpu reference."""
    op = portakern.explain(portakern.attention, q, k, v, backend="cpu", **ref_kw).op
    be = registry().backends[name]
    s = be.supports(op, device)
    assert s, s.reason
    out = torch.full(op.shapes()["out"], math.nan, dtype=q.dtype)
    lse = torch.full(op.shapes()["lse"], math.nan) if op.return_lse else None
    aux = {n: ref_kw.get(n) for n in ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")}
    be.compile(op, device)(q, k, v, out, lse, aux)
    ref, ref_lse = portakern.attention(q, k, v, backend="cpu", **ref_kw)
    assert (out.double() - ref.double()).abs().max() <= 3e-3
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() <= 1e-3
    return out, lse


def _qkv(B=2, Sq=5, Sk=9, Hq=4, Hkv=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=g).half() for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv))]


@pytest.mark.parametrize("name", ["fa4", "flashinfer"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(3, 0), softcap=2.0), dict(), dict(window=(2, -1))],
                         ids=["causal", "window-softcap", "none", "left-window"])
def test_dense_attention_matches_the_reference(name, kw, fa4, flashinfer):
    q, k, v = _qkv()
    _run(name, H100, q, k, v, ref_kw=dict(kw, return_lse=True))
    if name == "fa4":
        kind, call = fa4.calls[-1]
        assert kind == "dense" and call["return_lse"] and call["softcap"] == kw.get("softcap", 0.0)
        assert call["causal"] == kw.get("causal", False)
        assert call["softmax_scale"] == pytest.approx(1 / 8)
    else:
        assert len(flashinfer.calls) == 2 and flashinfer.calls[0]["shapes"] == ((5, 4, 64), (9, 2, 64))
        assert flashinfer.calls[0]["window_left"] == kw.get("window", (-1,))[0]


@pytest.mark.parametrize("name", ["fa4", "flashinfer"])
def test_rows_without_a_key_are_zero_and_minus_inf(name, fa4, flashinfer):
    q, k, v = _qkv(Sq=9, Sk=4)
    out, lse = _run(name, H100, q, k, v, ref_kw=dict(causal=True, return_lse=True))
    assert torch.all(out[:, :5] == 0) and torch.all(lse[:, :, :5] == -math.inf)


@pytest.mark.parametrize("name", ["fa4", "flashinfer"])
def test_paged_seqlens_and_varlen(name, fa4, flashinfer):
    q, k, v = _qkv(B=2, Sq=3, Sk=16)
    perm = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    kp, vp = k.reshape(8, 4, 2, 64)[perm], v.reshape(8, 4, 2, 64)[perm]
    table = torch.tensor([[1, 4, 3, 6], [0, 2, 5, 7]], dtype=torch.int64)     # int64 in: FA4 gets int32
    lens = torch.tensor([13, 6], dtype=torch.int64)
    _run(name, H100, q, kp, vp, ref_kw=dict(block_table=table, seqlens_k=lens, causal=True, return_lse=True))
    _run(name, H100, q, k, v, ref_kw=dict(seqlens_k=lens, window=(4, 0), return_lse=True))
    g = torch.Generator().manual_seed(1)
    qv, kv_, vv = (torch.randn(n, h, 64, generator=g).half() for n, h in ((6, 4), (8, 2), (8, 2)))
    _run(name, H100, qv, kv_, vv, ref_kw=dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
                                              cu_seqlens_k=torch.tensor([0, 5, 8], dtype=torch.int32),
                                              causal=True, return_lse=True))
    if name == "fa4":
        kinds = [kind for kind, _ in fa4.calls]
        assert kinds == ["varlen"] * 3
        assert fa4.calls[0][1]["page_table"].dtype == torch.int32 and fa4.calls[2][1]["cu_seqlens_q"] is not None


def _op(**kw):
    base = dict(batch=1, seqlen_q=128, seqlen_k=128, heads_q=8, heads_kv=8, head_dim=128, head_dim_v=128,
                dtype=DType.bfloat16, scale=0.1)
    return Attention(**{**base, **kw}).verify()


@pytest.mark.parametrize("name, op, device, reason", [
    ("fa4", _op(dtype=DType.float32), H100, "float16 / bfloat16"),
    ("fa4", _op(head_dim=80, head_dim_v=80), H100, "head dims"),
    ("fa4", _op(head_dim=192, head_dim_v=128), H100, "head dims"),
    ("fa4", _op(mask_mod=E.prefix_lm_mask(4)), H100, "neither"),
    ("fa4", _op(score_mod=E.alibi_score((0.5,) * 8)), H100, "softcap_score"),
    ("fa4", _op(), Device("cuda", 0, "sm_80", capability=(8, 0)), "sm_90"),
    ("fa4", _op(), Device("cuda", 0, "sm_120", capability=(12, 0)), "sm_90, sm_100 and sm_110"),
    ("flashinfer", _op(dtype=DType.float32), H100, "float16 / bfloat16"),
    ("flashinfer", _op(head_dim=96, head_dim_v=96), H100, "head_dim == head_dim_v in"),
    ("flashinfer", _op(mask_mod=E.window_mask(3, 2)), H100, "left window"),
    ("flashinfer", _op(mask_mod=E.document_mask((5,))), H100, "left window"),
    ("flashinfer", _op(score_mod=E.alibi_score((0.5,) * 8)), H100, "softcap_score"),
])
def test_refusals_name_the_limit(name, op, device, reason, fa4, flashinfer):
    s = registry().backends[name].supports(op, device)
    assert not s and reason in s.reason, s.reason


def test_fa4_takes_deepseek_head_dims_on_blackwell(fa4):
    assert registry().backends["fa4"].supports(_op(head_dim=192, head_dim_v=128), B200)


@pytest.mark.parametrize("name", ["fa4", "flashinfer"])
def test_quant_gemv_is_refused_with_the_way_out(name, fa4, flashinfer):
    s = registry().backends[name].supports(QuantGemv(1, 64, 128, DType.bfloat16, QuantFormat(4, 32, True)), H100)
    assert not s and "backend='torch'" in s.reason


@pytest.mark.parametrize("name, module, hint", [("fa4", "flash_attn", "pip install flash-attn-cute"),
                                                ("flashinfer", "flashinfer", "pip install flashinfer-python")])
def test_missing_package_is_an_info_line_with_the_install_command(name, module, hint, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)              # import fails, as without the package
    be = registry().backends[name]
    assert be.status().startswith("unavailable") and hint in be.status()
    s = be.supports(_op(), H100)
    assert not s and hint in s.reason
    assert name in {b.name for b in portakern.list_backends()}


@pytest.mark.parametrize("module, name", [("portakern.backends.torch", "torch"), ("portakern.backends.fa4", "fa4"),
                                          ("portakern.backends.flashinfer", "flashinfer")])
def test_a_measured_row_lifts_its_backend_for_its_class_only(module, name, monkeypatch):
    import importlib

    mod = importlib.import_module(module)
    be, op = registry().backends[name], _op(dtype=DType.float16)
    assert mod.portakern_backend_priority(be, op, H100) is None          # empty table: the default rank (-30)
    row = dict(backend=name, op="attention", family="sm_90", dtype="float16", max_d=128, decode=False,
               source="vendor-backends-h100.json")
    monkeypatch.setattr(mod, "RANK_OVER_OWN", (row,))
    assert mod.portakern_backend_priority(be, op, H100) == 120
    assert mod.portakern_backend_priority(be, op, B200) is None          # another family
    assert mod.portakern_backend_priority(be, _op(dtype=DType.bfloat16), H100) is None
    assert mod.portakern_backend_priority(be, _op(dtype=DType.float16, seqlen_q=1), H100) is None   # decode
    assert mod.portakern_backend_priority(registry().backends["triton"], op, H100) is None
