"""float64 references written out here in numpy (never a backend's code, nor the IR's evaluator).

``attention64``: dense BSHD attention with GQA (query head h reads kv head ``h // (Hq // Hkv)``), the
bottom-right aligned causal mask and window, softcap, and masks / score functions given as numpy callables of
broadcastable index grids ``(b, h, i, j, seqlen_q, seqlen_k)``. Rows that see no key give zeros and an LSE of
``-inf``; the LSE is the natural log of the sum of the exponentiated (scaled, modified) scores.

``gemv64``: ``x @ W.T`` in float64 with ``W = (codes - zero) * scale`` from the codes the test drew itself.
"""

from __future__ import annotations

import numpy as np


def attention64(q, k, v, *, scale=None, causal=False, window=None, softcap=0.0, score=None, mask=None,
                lens_k=None):
    """``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))`` in float64 from numpy ``q, k, v``."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Sq, Hq, Dv))
    lse = np.full((B, Hq, Sq), -np.inf)
    h = np.arange(Hq)[:, None, None]
    i = np.arange(Sq)[None, :, None]
    for b in range(B):
        sk = Sk if lens_k is None else int(lens_k[b])
        if sk == 0:
            continue
        kb, vb = np.repeat(k[b, :sk], G, axis=1), np.repeat(v[b, :sk], G, axis=1)   # (sk, Hq, D|Dv)
        s = np.einsum("qhd,khd->hqk", q[b], kb) * scale
        j = np.arange(sk)[None, None, :]
        diag = i + sk - Sq
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if score is not None:
            s = np.broadcast_to(score(s, b, h, i, j, Sq, sk), s.shape).astype(np.float64)
        keep = np.ones(s.shape, bool)
        if causal:
            keep &= j <= diag
        if window is not None:
            left, right = window
            if left >= 0:
                keep &= j >= diag - left
            if right >= 0:
                keep &= j <= diag + right
        if mask is not None:
            keep &= np.broadcast_to(mask(b, h, i, j, Sq, sk), s.shape)
        s = np.where(keep, s, -np.inf)
        m = s.max(-1, keepdims=True)
        seen = np.isfinite(m)
        p = np.exp(s - np.where(seen, m, 0.0))
        total = p.sum(-1, keepdims=True)
        out[b] = np.einsum("hqk,khd->qhd", np.divide(p, total, out=np.zeros_like(p), where=total > 0), vb)
        with np.errstate(divide="ignore"):
            lse[b] = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + np.where(seen, m, 0.0),
                              -np.inf)[..., 0]
    return out, lse


def gemv64(x, w64):
    """float64 ``x @ w64.T``."""
    return np.asarray(x, np.float64) @ np.asarray(w64, np.float64).T


def silu_mul64(x, K):
    """float64 ``silu(gate) * up = gate / (1 + exp(-gate)) * up`` of ``x = [gate | up]``."""
    x = np.asarray(x, np.float64)
    gate, up = x[:, :K], x[:, K:]
    with np.errstate(over="ignore"):
        return gate / (1.0 + np.exp(-gate)) * up
