"""The ``--check`` phase of ``benchmarks/attention.py``: every attention feature once, small enough for the cpu
reference, through the public API on a device (``portakern.attention(..., backend="triton")``) against the
cpu backend, outputs poisoned first.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools

import torch

from portakern.ir import expr as E


def check_cases():
    """(name, kwargs for make, call kwargs): every feature once, small enough for the cpu reference."""
    return [
        ("dense causal gqa4 d128 lse", dict(B=2, Sq=300, Sk=300, Hq=8, Hkv=2, D=128), dict(causal=True)),
        ("dense window fp16 d64", dict(B=1, Sq=257, Sk=513, Hq=4, Hkv=4, D=64, dt=torch.float16),
         dict(window=(64, 8))),
        ("dense softcap fp32 d96", dict(B=1, Sq=130, Sk=200, Hq=2, Hkv=1, D=96, dt=torch.float32),
         dict(softcap=20.0, causal=True)),
        ("d59 causal sq113 sk512", dict(B=1, Sq=113, Sk=512, Hq=4, Hkv=1, D=59), dict(causal=True)),
        ("d256 sq239 sk1", dict(B=2, Sq=239, Sk=1, Hq=2, Hkv=2, D=256), dict()),
        ("more queries than keys", dict(B=1, Sq=200, Sk=60, Hq=2, Hkv=1, D=128), dict(causal=True)),
        ("alibi + custom mask", dict(B=1, Sq=150, Sk=150, Hq=4, Hkv=2, D=64),
         dict(score_mod=E.alibi_score(E.alibi_slopes(4)), mask_mod=E.prefix_lm_mask(20))),
        ("decode split gqa4 sk4096", dict(B=2, Sq=1, Sk=4096, Hq=32, Hkv=8, D=128), dict(causal=True)),
        ("decode sq4 gqa8", dict(B=1, Sq=4, Sk=3000, Hq=16, Hkv=2, D=128), dict(causal=True)),
        ("paged16 decode", dict(B=3, Sq=1, Sk=2048, Hq=8, Hkv=2, D=128, page=16), dict()),
        ("paged64 prefill causal", dict(B=2, Sq=64, Sk=1024, Hq=8, Hkv=2, D=128, page=64), dict(causal=True)),
        ("paged256 decode", dict(B=2, Sq=1, Sk=4096, Hq=8, Hkv=1, D=128, page=256), dict()),
        ("dense seqlens_k", dict(B=3, Sq=5, Sk=700, Hq=8, Hkv=2, D=128, seqlens=True), dict(causal=True)),
        ("varlen causal padded", dict(B=4, Sq=0, Sk=0, Hq=8, Hkv=2, D=128, varlen=(70, 0, 190, 1)), dict(causal=True)),
        ("varlen decode", dict(B=6, Sq=0, Sk=0, Hq=32, Hkv=8, D=128, varlen=(1,) * 6), dict(causal=True)),
        ("non-contiguous q", dict(B=2, Sq=128, Sk=256, Hq=8, Hkv=2, D=128, strided=True), dict(causal=True)),
    ]


def make_inputs(B, Sq, Sk, Hq, Hkv, D, dt=torch.bfloat16, page=0, seqlens=False, varlen=None, strided=False):
    g = torch.Generator().manual_seed(B * 1000 + Sq + Sk + D)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    kw = {}
    if varlen:
        lens_q = list(varlen)
        lens_k = [max(n, 1) * 3 + 5 for n in lens_q]
        cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
        tq = int(cu_q[-1])
        q, k, v = rnd(tq, Hq, D), rnd(int(cu_k[-1]), Hkv, D), rnd(int(cu_k[-1]), Hkv, D)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    elif page:
        pages = B * Sk // page + 3
        q, k, v = rnd(B, Sq, Hq, D), rnd(pages, page, Hkv, D), rnd(pages, page, Hkv, D)
        table = torch.randperm(pages, generator=g)[: B * (Sk // page)].reshape(B, Sk // page).to(torch.int32)
        lens = torch.tensor([Sk - 17 * i for i in range(B)], dtype=torch.int32)
        kw = dict(block_table=table, seqlens_k=lens)
    else:
        q = rnd(B, Hq, Sq, D).transpose(1, 2) if strided else rnd(B, Sq, Hq, D)
        k, v = rnd(B, Sk, Hkv, D), rnd(B, Sk, Hkv, D)
        if seqlens:
            kw = dict(seqlens_k=torch.tensor([Sk, 0, Sk // 3][:B], dtype=torch.int32))
    return q, k, v, kw


def check_one(i, device="cuda"):
    """Check case ``i`` of ``check_cases()`` through the public API against the cpu backend."""
    import portakern
    from portakern.dispatch import poison_outputs

    name, shape, call = check_cases()[i]
    q, k, v, kw = make_inputs(**shape)
    cu = {n: a.to(device) for n, a in kw.items()}
    try:
        with poison_outputs():
            out, lse = portakern.attention(q.to(device), k.to(device), v.to(device), return_lse=True,
                                           backend="triton", **cu, **call)
        ref, ref_lse = portakern.attention(q, k, v, return_lse=True, backend="cpu", **kw, **call)
        err = (out.float().cpu() - ref.float()).abs().max().item()
        fin = torch.isfinite(ref_lse)
        lerr = (lse.cpu() - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
        same_inf = bool(torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse)))
        nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
        tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}[q.dtype]
        return dict(case=name, err=err, lse_err=lerr, ok=err <= tol and lerr <= 1e-3 and same_inf and not nan)
    except Exception as e:
        return dict(case=name, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")


def run_check(device="cuda", workers=1):
    n = len(check_cases())
    if workers > 1:
        ctx = __import__("multiprocessing").get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=min(workers, n), mp_context=ctx) as ex:
            rows = list(ex.map(check_one, range(n), [device] * n))
    else:
        rows = [check_one(i, device) for i in range(n)]
    for r in rows:
        print(f"check {'PASS' if r['ok'] else 'FAIL'} {r['case']:28s} err={r.get('err', float('nan')):.2e} "
              f"lse={r.get('lse_err', float('nan')):.2e} {r.get('error', '')}", flush=True)
    return rows
