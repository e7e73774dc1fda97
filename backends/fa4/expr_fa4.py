"""Match ``score_mod`` / ``mask_mod`` trees against the fixed features of a vendor attention kernel.

FlashAttention-4 and FlashInfer take no expression language portakern can lower to: they take flags -- a causal
mask and a sliding window (both bottom-right aligned, as portakern's ``causal_mask()`` / ``window_mask(l, r)``),
and a logit softcap (``softcap_score(cap)``). ``mask_window`` and ``softcap_of`` read those flags off a tree by
its structure; any other tree is not expressible and the backend refuses it with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from portakern.ir.expr import Expr, Op, causal_mask, softcap_score, window_bound, window_mask



@dataclass(frozen=True)
class Window:
    """Keys ``diag - left <= j <= diag + right`` (None: unbounded on that side); ``Window()`` sees every key."""

    left: int | None = None
    right: int | None = None

    @property
    def causal(self) -> bool:
        return self.left is None and self.right == 0


def mask_window(mask_mod: Expr | None) -> Window | None:
    """The window ``mask_mod`` is (``causal_mask()``, ``window_mask(l, r)`` or None), or None when it is any
    other mask."""
    if mask_mod is None:
        return Window()
    terms = list(mask_mod.args) if mask_mod.op is Op.AND else [mask_mod]
    found: dict[str, int] = {}
    for term in terms:
        b = window_bound(term)
        if b is None or b[0] in found:
            return None
        found[b[0]] = b[1]
    w = Window(found.get("left"), found.get("right"))
    rebuilt = window_mask(-1 if w.left is None else w.left, -1 if w.right is None else w.right)
    return w if mask_mod in (rebuilt, causal_mask()) and w.causal or rebuilt == mask_mod else None


def softcap_of(score_mod: Expr | None) -> float | None:
    """``cap`` when ``score_mod`` is ``softcap_score(cap)``; 0.0 when it is None; None for any other score_mod."""
    if score_mod is None:
        return 0.0
    if score_mod.op is Op.MUL and score_mod.args[0].op is Op.CONST and isinstance(score_mod.args[0].value, float):
        cap = score_mod.args[0].value
        if cap > 0 and softcap_score(cap) == score_mod:
            return cap
    return None
