"""The triton backend's path for a weight held only as fragments (``layout="fragments"``: ``PreparedGemvWeight.has_words``
False) where its "frag" kernel cannot run the call: M > 16 (prefill), fp16 or fp32 activations, a ``silu_mul``
prologue, or Triton's CPU interpreter (the "frag" kernel is Gluon). The word kernels ("fma", "dot", "mma", "stream")
cannot serve such a weight: they read ``qweight``, which it does not hold.

``FragmentsDense`` dequantizes the fragments to x's dtype on the weight's device with torch ops
(``portakern.gemv_torch.unpack_fragments``, then ``(code - zero) * scale`` in fp32, ``ROWS_PER_STEP`` rows at a time)
and runs one ``torch.matmul``. At M > 16 the product is compute-bound (2 M N K flops against N K / 2 bytes of codes),
so one transient dense copy of the weight (2 bytes per parameter in fp16 / bf16) costs little beside the matmul; at
small M with fp16 x it is a slower path than a GEMV kernel, which is why the cuda backend's fragment kernel (fp16 and
bf16, M <= 4) ranks first there for fragments-only weights (``backends/cuda/__init__.py``). The dense copy is never
cached: a resident one would undo what a fragments-only weight is for (each code held once).

CUDA-graph contract: torch ops only, no host synchronisation and no host-to-device copy (``unpack_fragments`` uses
no index tensor), so the path runs inside CUDA stream capture; its transients come from the caching allocator (the
graph's private pool under capture) and are released before the call returns.
"""

from __future__ import annotations

from portakern.errors import InvalidInputError
from portakern.ir.ops import QuantGemv

#: weight rows dequantized in fp32 at once (a multiple of 16: whole fragment units): bounds the fp32 transient
ROWS_PER_STEP = 4096


def dequantize_fragments(w, dtype):
    """The dense ``(N, K)`` weight of the fragments-only prepared weight ``w`` in the torch ``dtype``, on ``w``'s
    device: ``(code - zero) * scale`` computed in fp32 and rounded once to ``dtype``.

    Raises ``InvalidInputError`` when ``w`` holds no fragment layout or carries what that layout never has
    (act-order ``perm`` / ``kgroup``, GGUF minimums)."""
    import torch

    from portakern.gemv_torch import unpack_fragments

    if w.frag is None or w.perm is not None or w.kgroup is not None or w.mins is not None:
        raise InvalidInputError("dequantize_fragments: the prepared weight has no fragment layout, or carries an "
                                "act-order permutation or GGUF minimums that it never holds; pass a weight prepared "
                                "with layout='fragments' (int4, groups a multiple of 128, no act-order)")
    N, K, GS = w.N, w.K, w.group_size
    dense = torch.empty((N, K), dtype=dtype, device=w.frag.device)
    for r0 in range(0, N, ROWS_PER_STEP):
        r1 = min(N, r0 + ROWS_PER_STEP)
        codes = unpack_fragments(w.frag[:, r0 // 16: -(-r1 // 16)], r1 - r0, K).float()       # (rows, K)
        scale = w.scales[:, r0:r1].T.float().repeat_interleave(GS, dim=1)[:, :K]
        zero = (w.zeros[:, r0:r1].T.float().repeat_interleave(GS, dim=1)[:, :K] if w.zeros is not None
                else float(w.zero_point))
        dense[r0:r1] = ((codes - zero) * scale).to(dtype)
    return dense


class FragmentsDense:
    """``launcher(x, w, out)`` for ``op``: ``out = x_in @ dequantize_fragments(w)^T`` (computed in x's dtype by
    ``torch.matmul``, then copied into ``out``), where ``x_in`` is ``x`` or,
    with the ``silu_mul`` prologue, ``silu(gate) * up`` computed in fp32 and rounded to x's dtype. ``why``: the reason
    the "frag" kernel cannot run the call (``kernel.launchers`` introspection)."""

    kind = "fragments-dense"
    cfg = None

    def __init__(self, op: QuantGemv, why: str):
        self.op, self.why = op, why

    def __call__(self, x, w, out) -> None:
        import torch

        dense = dequantize_fragments(w, x.dtype)
        if self.op.prologue == "silu_mul":
            xf = x.float()
            x = (torch.nn.functional.silu(xf[:, : w.K]) * xf[:, w.K:]).to(x.dtype)
        out.copy_(torch.matmul(x, dense.T))


__all__ = ["FragmentsDense", "ROWS_PER_STEP", "dequantize_fragments"]
