"""The "naive" computation of each case: the same math done in the case's storage dtype.

This is the yardstick of the tolerance rule (the FlashAttention practice): a backend passes when
its error against the float64 gold is at most twice the error of this naive computation plus a
floor. Naive means what a framework does with plain ops on ``dtype`` tensors: every matmul
accumulates in float32 and its result is rounded to ``dtype``; elementwise results are rounded to
``dtype``; softmax is computed in float32 and its probabilities rounded to ``dtype``.

Attention, per batch entry and query head::

    s = rd(rd(q @ k^T) * scale);  s = rd(score_mod(s));  masked -> -inf
    p = rd(softmax_f32(s));  out = rd(p @ v);  lse = logsumexp_f32(s)

Quantized GEMV::

    w = rd((codes - zero) * scale);  out = rd(x @ w^T)

where ``rd`` rounds float32 to the storage dtype (identity for float32). The error figures are
computed once, when goldens are generated, and stored in the manifest.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .generate import round_to


def attention(case, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Naive ``(out, lse)`` of an attention case: out float32 in ``op.shapes()['out']``, lse too."""
    from portakern.ir.evaluate import evaluate
    from portakern.validate import attention_op

    aux = {k: v for k, v in inputs.items() if k not in ("q", "k", "v")}
    kw = dict(case.kwargs(), return_lse=True)
    op, _ = attention_op(inputs["q"], inputs["k"], inputs["v"], **kw, **aux)
    shapes = op.shapes()
    out = np.zeros(shapes["out"], dtype=np.float32)
    lse = np.full(shapes["lse"], -np.inf, dtype=np.float32)
    dt, G = case.dtype, op.group_size
    for b, q, k, v, o_rows, l_rows in _sequences(case, inputs, out, lse):
        Sq, Sk = q.shape[0], k.shape[0]
        if Sq == 0 or Sk == 0:
            continue
        env = {"b": b, "seqlen_q": Sq, "seqlen_k": Sk, "q_idx": np.arange(Sq)[None, :, None],
               "kv_idx": np.arange(Sk)[None, None, :]}
        for j in range(op.heads_kv):
            heads = slice(j * G, (j + 1) * G)
            env["h"] = np.arange(j * G, (j + 1) * G)[:, None, None]
            qh = np.ascontiguousarray(q[:, heads].transpose(1, 0, 2))          # (G, Sq, D)
            s = round_to(round_to(qh @ k[:, j].T, dt) * np.float32(op.scale), dt)
            with np.errstate(all="ignore"):
                if op.score_mod is not None:
                    s = round_to(np.broadcast_to(evaluate(op.score_mod, {**env, "score": s}), s.shape), dt)
                if op.mask_mod is not None:
                    keep = np.broadcast_to(evaluate(op.mask_mod, env).astype(bool), s.shape)
                    s = np.where(keep, s, np.float32(-np.inf))
                m = s.max(axis=-1, keepdims=True)
                m = np.where(np.isneginf(m), np.float32(0), m)
                e = np.exp(s - m, dtype=np.float32)
                l = e.sum(axis=-1, keepdims=True, dtype=np.float32)
                seen = l != 0          # NaN != 0: a poisoned row stays NaN, as in the reference
                p = round_to(np.where(seen, e / np.where(seen, l, 1), 0), dt)
                o = round_to(p @ v[:, j], dt)                                 # (G, Sq, Dv)
                lrow = np.where(seen[..., 0], m[..., 0] + np.log(np.where(seen[..., 0], l[..., 0], 1)),
                                -np.inf).astype(np.float32)
            o_rows[:, heads] = o.transpose(1, 0, 2)
            l_rows[heads] = lrow
    return out, lse


def _sequences(case, inputs, out, lse) -> Iterator[tuple]:
    """Yield ``(b, q, k, v, out rows, lse rows)`` per batch entry, with KV gathered to dense."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if case.layout == "varlen":
        cq, ck = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
        for b in range(case.B):
            qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
            yield b, q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], lse[:, qs:qe]
        return
    for b in range(case.B):
        if case.layout == "paged":
            L, ps = int(inputs["seqlens_k"][b]), case.page_size
            pages = inputs["block_table"][b, : -(-L // ps)]
            kb = k[pages].reshape(-1, case.Hkv, case.D)[:L]
            vb = v[pages].reshape(-1, case.Hkv, case.dv)[:L]
        else:
            L = case.Sk if "seqlens_k" not in inputs else int(inputs["seqlens_k"][b])
            kb, vb = k[b, :L], v[b, :L]
        yield b, q[b], kb, vb, out[b], lse[b]


def quant_gemv(case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Naive ``out (M, N)`` float32 of a quantized GEMV case (``silu_mul``: the input ``silu(gate) * up`` in float32,
    as ``gate / (1 + exp(-gate)) * up``)."""
    dt = case.dtype
    w = round_to(case.dequantized(inputs).astype(np.float32), dt)
    x = inputs["x"].astype(np.float32)
    if case.prologue == "silu_mul":
        gate, up = x[:, :case.K], x[:, case.K:]
        with np.errstate(over="ignore"):
            x = (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)
    return round_to(x @ w.T, dt)


def errors(gold: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """``(max |other - gold|, NMSE)`` over the entries where gold is finite."""
    fin = np.isfinite(gold)
    if not fin.any():
        return 0.0, 0.0
    g = gold[fin].astype(np.float64)
    d = other[fin].astype(np.float64) - g
    denom = float(np.sum(g * g))
    return float(np.max(np.abs(d))), float(np.sum(d * d) / denom) if denom > 0 else 0.0
