"""Reference attention in numpy, float64 inside. This is the executable form of ``docs/ir.md``.

For each batch entry ``b`` and query head ``h`` (reading kv head ``h // (Hq // Hkv)``)::

    s[i, j]   = scale * q[i] . k[j]                       the scaled score
    s[i, j]   = score_mod(s[i, j], b, h, i, j, Sq_b, Sk_b)  when the op has a score_mod
    visible   = j < Sk_b  and  mask_mod(b, h, i, j, Sq_b, Sk_b)  (True keeps the key)
    out[i]    = sum_j softmax_j(s[i, visible]) v[j]        zeros when no key is visible
    lse[i]    = log sum_j exp(s[i, j]) over visible j      -inf when no key is visible

in IEEE float64: a NaN or +inf score of a visible key makes row ``i``'s output and LSE NaN, a -inf
score gets weight 0 (a row whose visible scores are all -inf is treated as one with no visible key),
and a hidden key's score never counts (docs/ir.md, "Non-finite values").

``Sq_b`` / ``Sk_b`` are the actual lengths of batch entry ``b`` (the ``seqlen_q`` / ``seqlen_k``
expression variables): ``seqlens_k[b]`` for dense-with-lengths and paged KV, the
``cu_seqlens`` differences for varlen. Causal, sliding window, softcap and ALiBi arrive as library
expressions in ``score_mod`` / ``mask_mod``; nothing here special-cases them.

The kernel walks batch entries and kv heads and vectorises the group of query heads that share a
kv head together with a chunk of query rows, keeping each score block under ``tuning.SCORE_BLOCK_ELEMENTS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from portakern.errors import InvalidInputError
from portakern.ir.ops import Attention, KVLayout
from portakern.lengths import attention_at

from . import tuning
from .expr_numpy import lower


@dataclass
class _Sequence:
    """One batch entry, gathered to dense views: q (Sq_b, Hq, D), k/v (Sk_b, Hkv, D|Dv)."""

    b: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray            # (Sq_b, Hq, Dv) view into the caller's out
    lse: np.ndarray | None     # (Hq, Sq_b) view into the caller's lse


def attention_kernel(op: Attention) -> Callable[..., None]:
    """Build the reference kernel for ``op``: ``kernel(q, k, v, out, lse, aux)``.

    Args:
        op: a verified ``Attention`` node (any KV layout, any mods).

    Returns:
        A function that reads numpy ``q``, ``k``, ``v`` (shapes ``op.shapes()``, at the call's own
        sequence lengths: ``portakern.lengths``; bf16 arrives as
        float32), computes in float64 and writes every element of ``out`` (cast to its dtype) and,
        when ``lse`` is not None, of ``lse`` (float32). ``aux`` maps ``block_table``,
        ``seqlens_k``, ``cu_seqlens_q``, ``cu_seqlens_k`` to integer arrays or None.

    Raises (from the kernel):
        InvalidInputError: an operand has the wrong shape, or ``aux`` is missing or inconsistent
            (lengths out of range, page ids outside the pool, decreasing cu_seqlens).
    """
    op.verify()

    def kernel(q, k, v, out, lse, aux=None) -> None:
        aux = dict(aux or {})
        at = _at_lengths(op, q, k, aux)  # one kernel serves every sequence length of op's shape class
        _check_shapes(at, q, k, v, out, lse)
        for seq in _sequences(at, q, k, v, out, lse, aux):
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf inputs: IEEE results, no warnings
                _attend(at, seq)

    kernel.__name__ = f"cpu_attention_{op.content_hash()}"
    return kernel


def compile(op: Attention, device=None) -> Callable[..., None]:
    """The lowering's entry point for the backend base: ``attention_kernel(op)`` (the host is the only device)."""
    return attention_kernel(op)


# -- per-sequence math ---------------------------------------------------------------------------

def _attend(op: Attention, seq: _Sequence) -> None:
    """Attention of one batch entry: every query head, every query row of ``seq``."""
    Sq, Sk = seq.q.shape[0], seq.k.shape[0]
    if Sq == 0:
        return
    if Sk == 0:  # no keys at all: every row is fully masked
        seq.out[...] = 0
        if seq.lse is not None:
            seq.lse[...] = -np.inf
        return

    G, D, Dv = op.group_size, op.head_dim, op.head_dim_v
    q64 = seq.q.astype(np.float64)
    k64 = seq.k.astype(np.float64)
    v64 = seq.v.astype(np.float64)
    env = {"b": seq.b, "seqlen_q": Sq, "seqlen_k": Sk,
           "kv_idx": np.arange(Sk, dtype=np.int64)[None, None, :]}
    # A mask that ignores the head is evaluated once per query chunk and shared by all kv heads.
    mask_per_head = op.mask_mod is not None and "h" in op.mask_mod.variables()
    score_fn = lower(op.score_mod) if op.score_mod is not None else None
    mask_fn = lower(op.mask_mod) if op.mask_mod is not None else None
    rows = max(1, tuning.SCORE_BLOCK_ELEMENTS // (G * Sk))

    for q0 in range(0, Sq, rows):
        q1 = min(Sq, q0 + rows)
        c = q1 - q0
        env["q_idx"] = np.arange(q0, q1, dtype=np.int64)[None, :, None]
        shared_mask = None
        if op.mask_mod is not None and not mask_per_head:
            shared_mask = mask_fn(env).astype(bool, copy=False)

        for j in range(op.heads_kv):
            heads = slice(j * G, (j + 1) * G)
            env["h"] = np.arange(j * G, (j + 1) * G, dtype=np.int64)[:, None, None]

            # -- compute qk: s (G, c, Sk) = scale * q . k
            qg = np.ascontiguousarray(q64[q0:q1, heads].transpose(1, 0, 2)).reshape(G * c, D)
            s = (qg @ k64[:, j].T).reshape(G, c, Sk)
            s *= op.scale

            # -- score_mod: the new score, evaluated on every (head, row, key)
            if op.score_mod is not None:
                modded = score_fn({**env, "score": s})
                s = np.array(np.broadcast_to(modded, s.shape), dtype=np.float64)

            # -- mask_mod: hidden keys get -inf
            if op.mask_mod is not None:
                keep = shared_mask if shared_mask is not None else \
                    mask_fn(env).astype(bool, copy=False)
                np.copyto(s, -np.inf, where=~keep)

            # -- softmax numerator with the row max subtracted (0 for fully masked rows). IEEE
            #    float64 throughout: a NaN score makes the max, the sum and so the row NaN; a +inf
            #    score gives inf - inf = NaN; a -inf score gets weight exp(-inf) = 0
            row_max = s.max(axis=-1, keepdims=True)
            row_max[row_max == -np.inf] = 0.0
            s -= row_max
            np.exp(s, out=s)
            denom = s.sum(axis=-1)                  # (G, c); 0 where no key is visible, NaN where poisoned
            visible = denom != 0                    # NaN != 0: a poisoned row is normalised, so stays NaN

            # -- P V, then normalise; a fully masked row stays 0
            o = (s.reshape(G * c, Sk) @ v64[:, j]).reshape(G, c, Dv)
            o = np.divide(o, denom[..., None], out=np.zeros_like(o), where=visible[..., None])
            seq.out[q0:q1, heads] = o.transpose(1, 0, 2)

            # -- log-sum-exp of the visible scores
            if seq.lse is not None:
                safe = np.where(visible, denom, 1.0)
                seq.lse[heads, q0:q1] = np.where(visible, row_max[..., 0] + np.log(safe), -np.inf)


# -- layouts -> per-sequence views ----------------------------------------------------------------

def _sequences(op: Attention, q, k, v, out, lse, aux: dict) -> Iterator[_Sequence]:
    """Yield each batch entry of any KV layout as dense views (gathering pages when paged)."""
    if op.kv_layout is KVLayout.VARLEN:
        yield from _varlen_sequences(op, q, k, v, out, lse, aux)
        return
    if op.kv_layout is KVLayout.PAGED:
        _reject(aux, "cu_seqlens_q", "cu_seqlens_k")
        lengths = _lengths(op, aux, capacity=op.max_pages * op.page_size)
        table = _block_table(op, aux)
    else:
        _reject(aux, "block_table", "cu_seqlens_q", "cu_seqlens_k",
                *(() if op.has_seqlens_k else ("seqlens_k",)))
        lengths = _lengths(op, aux, capacity=op.seqlen_k) if op.has_seqlens_k else None
    for b in range(op.batch):
        if op.kv_layout is KVLayout.PAGED:
            L = int(lengths[b])
            pages = table[b, : -(-L // op.page_size)]
            kb = k[pages].reshape(-1, op.heads_kv, op.head_dim)[:L]
            vb = v[pages].reshape(-1, op.heads_kv, op.head_dim_v)[:L]
        else:
            L = op.seqlen_k if lengths is None else int(lengths[b])
            kb, vb = k[b, :L], v[b, :L]
        yield _Sequence(b, q[b], kb, vb, out[b], None if lse is None else lse[b])


def _varlen_sequences(op: Attention, q, k, v, out, lse, aux: dict) -> Iterator[_Sequence]:
    """Slice packed varlen operands by ``cu_seqlens``; rows past the last sequence are padding."""
    _reject(aux, "block_table", "seqlens_k")
    cu_q = _cu_seqlens(op, aux, "cu_seqlens_q", op.total_q, op.seqlen_q)
    cu_k = _cu_seqlens(op, aux, "cu_seqlens_k", op.total_k, op.seqlen_k)
    for b in range(op.batch):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        yield _Sequence(b, q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe],
                        None if lse is None else lse[:, qs:qe])
    # padding rows after the last sequence see no keys
    end = int(cu_q[-1])
    out[end:] = 0
    if lse is not None:
        lse[:, end:] = -np.inf


# -- operand checks -------------------------------------------------------------------------------

def _at_lengths(op: Attention, q, k, aux: dict) -> Attention:
    """``op`` at the sequence lengths of this call's ``q``, ``k`` and block table (``CpuBackend.runtime_lengths``);
    ``op`` itself when a rank is not the op's (``_check_shapes`` then names the operand)."""
    want = op.shapes()
    bt = getattr(aux.get("block_table"), "shape", None) if op.kv_layout is KVLayout.PAGED else ()
    if len(q.shape) != len(want["q"]) or len(k.shape) != len(want["k"]) or bt is None or (bt and len(bt) != 2):
        return op
    return attention_at(op, tuple(q.shape), tuple(k.shape), tuple(bt) or None)


def _check_shapes(op: Attention, q, k, v, out, lse) -> None:
    """Raise naming the operand when a shape differs from ``op.shapes()``."""
    want = op.shapes()
    given = {"q": q, "k": k, "v": v, "out": out}
    if op.return_lse:
        if lse is None:
            raise InvalidInputError("lse is None but the op has return_lse=True: pass a float32 "
                                    f"array of shape {want['lse']}")
        given["lse"] = lse
    for name, arr in given.items():
        if tuple(arr.shape) != want[name]:
            raise InvalidInputError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]} "
                                    f"for this {op.kv_layout.value} attention op")


def _int_array(aux: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``aux[name]`` as an int64 array of ``shape``; raise when missing or misshapen."""
    value = aux.get(name)
    if value is None:
        raise InvalidInputError(f"aux[{name!r}] is missing: this attention op needs it")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"aux[{name!r}] has dtype {arr.dtype}: it must hold integers; "
                                "convert it with .astype(numpy.int32)")
    if arr.shape != shape:
        raise InvalidInputError(f"aux[{name!r}] has shape {arr.shape}, expected {shape}: index arrays "
                                "are sized by the op's batch (and max_pages for block_table)")
    return arr.astype(np.int64, copy=False)


def _reject(aux: dict, *names: str) -> None:
    """Raise when ``aux`` carries an array this layout does not read (a caller mix-up)."""
    for name in names:
        if aux.get(name) is not None:
            raise InvalidInputError(f"aux[{name!r}] was given but this attention op does not read "
                                    "it: pass it only with the KV layout that uses it")


def _lengths(op: Attention, aux: dict, capacity: int) -> np.ndarray:
    """Per-batch key lengths ``seqlens_k`` (B,), each in ``[0, capacity]``."""
    lengths = _int_array(aux, "seqlens_k", (op.batch,))
    bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
    if bad.size:
        b = int(bad[0])
        raise InvalidInputError(f"seqlens_k[{b}]={int(lengths[b])} is outside [0, {capacity}]: "
                                "a length may not exceed the keys the layout can hold")
    return lengths


def _block_table(op: Attention, aux: dict) -> np.ndarray:
    """The paged block table (B, max_pages); entries that are read must name a page in the pool."""
    table = _int_array(aux, "block_table", (op.batch, op.max_pages))
    lengths = _int_array(aux, "seqlens_k", (op.batch,))
    for b in range(op.batch):
        used = table[b, : -(-int(lengths[b]) // op.page_size)]
        bad = np.flatnonzero((used < 0) | (used >= op.num_pages))
        if bad.size:
            p = int(bad[0])
            raise InvalidInputError(f"block_table[{b}, {p}]={int(used[p])} is not a page id in "
                                    f"[0, {op.num_pages}): every page holding keys of seqlens_k[{b}] "
                                    "must exist")
    return table


def _cu_seqlens(op: Attention, aux: dict, name: str, total: int, longest: int) -> np.ndarray:
    """Cumulative lengths (B + 1,): start at 0, never decrease, end within ``total``."""
    cu = _int_array(aux, name, (op.batch + 1,))
    lengths = np.diff(cu)
    if cu[0] != 0:
        raise InvalidInputError(f"{name}[0]={int(cu[0])} must be 0: cumulative lengths start at 0; "
                                "build them as numpy.cumsum([0, *lengths])")
    if (lengths < 0).any():
        b = int(np.flatnonzero(lengths < 0)[0])
        raise InvalidInputError(f"{name} decreases at index {b + 1}: cumulative lengths never decrease")
    if cu[-1] > total:
        raise InvalidInputError(f"{name}[-1]={int(cu[-1])} exceeds the {total} packed rows: the last "
                                "cumulative length may not pass the end of the packed array")
    if (lengths > longest).any():
        b = int(np.flatnonzero(lengths > longest)[0])
        raise InvalidInputError(f"{name}: sequence {b} has length {int(lengths[b])}, more than the "
                                f"op's maximum {longest} (seqlen_{name[-1]})")
    return cu
