"""Shape classes: which dimensions of a call are sequence lengths, and the op at a call's own lengths.

A decode loop grows the key length by one every step; a server sees a new query length with every prompt. Dispatch
plans once per *shape class*: the call's signature with each sequence length replaced by its class (0, 1, or
"2 and more", see ``length_class``) and each array's strides by its innermost stride (the only stride validation
reads). Validation, the candidates, the ranking and (for a backend whose kernels read the lengths at run time,
``Backend.runtime_lengths``) the compiled kernel then serve every length of the class.

The lengths, by KV layout (the dimensions left out of the plan key):

* dense: ``q``'s seqlen_q (axis 1), ``k``'s and ``v``'s seqlen_k (axis 1);
* varlen: ``q``'s total_q (axis 0), ``k``'s and ``v``'s total_k (axis 0);
* paged: ``q``'s seqlen_q (axis 1) and the block table's max_pages (axis 1); the page pool (``k``, ``v``) is kept
  whole, as it rarely changes size.

What validation checks between lengths stays in the key as a relation: ``k`` and ``v`` have one key length. Lengths
whose *values* validation reads (``seqlens_k``, ``cu_seqlens_*``) are index arrays: on the host they are checked
every call, on a device on a signature's first call, as before.
"""

from __future__ import annotations

from typing import Any

from portakern.ir.ops import Attention, KVLayout


def length_class(n: int) -> int:
    """The class of one length: 0 (empty: no kernel runs), 1 (decode's single query row), or 2 for every longer one."""
    return n if n < 2 else 2


def attention_axes(paged: bool, varlen: bool) -> tuple[int, int | None, int | None]:
    """The length axis of ``q``, of ``k`` / ``v`` (None: kept whole) and of ``block_table`` (None: not paged)."""
    if varlen:
        return 0, 0, None
    if paged:
        return 1, None, 1
    return 1, 1, None


def attention_at(op: Attention, q_shape: tuple, k_shape: tuple, block_table_shape: tuple | None = None) -> Attention:
    """``op`` (built by validation for one member of a shape class) at the lengths of another member, whose arrays
    have these shapes; ``op`` itself when the lengths are its own."""
    if op.kv_layout is KVLayout.VARLEN:
        tq, tk = max(q_shape[0], 1), k_shape[0]
        if (tq, tk) == (op.total_q, op.total_k):
            return op
        return op.replace(seqlen_q=tq, seqlen_k=tk, total_q=tq, total_k=tk)
    sq = max(q_shape[1], 1)
    if op.kv_layout is KVLayout.PAGED:
        sk = block_table_shape[1] * op.page_size
        if (sq, sk, k_shape[0]) == (op.seqlen_q, op.seqlen_k, op.num_pages):
            return op
        return op.replace(seqlen_q=sq, seqlen_k=sk, num_pages=k_shape[0])
    if (sq, k_shape[1]) == (op.seqlen_q, op.seqlen_k):
        return op
    return op.replace(seqlen_q=sq, seqlen_k=k_shape[1])


def attention_shapes(op: Attention, q_shape: tuple) -> dict[str, Any]:
    """The ``out`` and ``lse`` shapes of a call of ``op``'s shape class whose ``q`` has shape ``q_shape`` (the
    outputs follow ``q``'s rows: ``(*rows, Hq, Dv)``, and lse ``(B, Hq, Sq)`` or ``(Hq, total_q)`` for varlen)."""
    out = (*q_shape[:-2], op.heads_q, op.head_dim_v)
    if op.kv_layout is KVLayout.VARLEN:
        return {"out": out, "lse": (op.heads_q, q_shape[0])}
    return {"out": out, "lse": (q_shape[0], op.heads_q, q_shape[1])}


__all__ = ["attention_at", "attention_axes", "attention_shapes", "length_class"]
