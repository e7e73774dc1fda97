"""Random attention problems (seeded): every layout, GQA ratios, odd head dims, masks, softcap, negative scales,
ALiBi, empty sequences, page size 1 -- the opencl backend against the cpu reference (float64) on the same
inputs: outputs within the dtype's tolerance, the same -inf LSE rows, LSE within 1e-3, no NaN."""

from __future__ import annotations

import numpy as np

import portakern
from portakern.ir import expr as E

from opencl_helpers import require_opencl

N = 30


def test_random_problems_match_the_reference():
    require_opencl()
    rng = np.random.default_rng(5)
    bad = []
    for it in range(N):
        B = int(rng.integers(1, 4)); Sq = int(rng.integers(1, 40)); Sk = int(rng.integers(1, 90))
        Hkv = int(rng.choice([1, 2])); G = int(rng.choice([1, 2, 3, 8])); Hq = Hkv * G
        D = int(rng.choice([1, 3, 16, 59, 111, 200])); Dv = int(rng.choice([1, D, 33, 256]))
        dt = rng.choice([np.float16, np.float32])
        kw = {}
        if rng.random() < .4: kw["causal"] = True
        if rng.random() < .3: kw["window"] = (int(rng.integers(-1, 10)), int(rng.integers(-1, 5)))
        if rng.random() < .3: kw["softcap"] = float(rng.uniform(1, 20))
        if rng.random() < .3: kw["scale"] = float(rng.uniform(-1, 1)) or 0.5
        if rng.random() < .2: kw["score_mod"] = E.alibi_score(tuple(float(x) for x in rng.uniform(0, 1, Hq)))
        layout = rng.choice(["dense", "lens", "paged", "varlen"])
        q = rng.standard_normal((B, Sq, Hq, D)).astype(dt); k = rng.standard_normal((B, Sk, Hkv, D)).astype(dt); v = rng.standard_normal((B, Sk, Hkv, Dv)).astype(dt)
        if layout == "lens":
            kw["seqlens_k"] = rng.integers(0, Sk + 1, B).astype(np.int32)
        elif layout == "paged":
            ps = int(rng.choice([1, 4, 16])); mp = -(-Sk // ps); P = B * mp + 1
            kp = rng.standard_normal((P, ps, Hkv, D)).astype(dt); vp = rng.standard_normal((P, ps, Hkv, Dv)).astype(dt)
            bt = rng.permutation(P)[:B * mp].reshape(B, mp).astype(np.int32)
            kw.update(block_table=bt, seqlens_k=rng.integers(0, mp * ps + 1, B).astype(np.int64)); k, v = kp, vp
        elif layout == "varlen":
            ql = rng.integers(0, Sq + 1, B); kl = rng.integers(0, Sk + 1, B)
            kw.update(cu_seqlens_q=np.cumsum([0, *ql]).astype(np.int32), cu_seqlens_k=np.cumsum([0, *kl]).astype(np.int32))
            q = q.reshape(-1, Hq, D)[: max(1, ql.sum())]; k = k.reshape(-1, Hkv, D)[: max(1, kl.sum())]; v = v.reshape(-1, Hkv, Dv)[: max(1, kl.sum())]
            if ql.sum() == 0 or kl.sum() == 0: continue
        o, l = portakern.attention(q, k, v, backend="opencl", return_lse=True, **kw)
        r, rl = portakern.attention(q, k, v, backend="cpu", return_lse=True, **kw)
        err = np.abs(o.astype(float) - r.astype(float)).max() if o.size else 0
        tol = 4e-3 if dt == np.float16 else 5e-5
        fin = np.isfinite(rl)
        lerr = np.abs(l[fin] - rl[fin]).max() if fin.any() else 0
        if err > tol * max(1, np.abs(r).max()) or not np.array_equal(np.isinf(l), np.isinf(rl)) or lerr > 1e-3 or np.isnan(o).any():
            bad.append((it, layout, B, Sq, Sk, Hq, Hkv, D, Dv, dt.__name__, sorted(kw), err, lerr))
    assert not bad, bad
