"""Read FlashInfer's flags off a ``score_mod`` / ``mask_mod`` tree.

FlashInfer's single-sequence kernels take a causal flag, a left window (``window_left``: keys
``j >= i + Sk - Sq - left``) and a logit softcap; masks are bottom-right aligned, as portakern's. A tree is
expressible when it *is* one of the library expressions built from those flags -- ``causal_mask()``,
``window_mask(left, 0)``, ``window_mask(left, -1)``, ``softcap_score(cap)`` -- for a constant that occurs in it;
the match is by equality of trees, so any other expression is refused.
"""

from __future__ import annotations

from portakern.ir.expr import Expr, Op, causal_mask, softcap_score, window_mask


def _constants(expr: Expr, kind: type) -> set:
    found, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if node.op is Op.CONST and type(node.value) is kind:
            found.add(node.value)
        stack.extend(node.args)
    return found


def mask_flags(mask_mod: Expr | None) -> tuple[bool, int] | None:
    """``(causal, window_left)`` (-1: no left bound) for the masks FlashInfer takes, or None for any other mask."""
    if mask_mod is None:
        return False, -1
    if mask_mod == causal_mask():
        return True, -1
    for left in sorted(_constants(mask_mod, int)):
        if left >= 0 and mask_mod == window_mask(left, 0):
            return True, left
        if left >= 0 and mask_mod == window_mask(left, -1):
            return False, left
    return None


def softcap_flag(score_mod: Expr | None) -> float | None:
    """``cap`` when ``score_mod`` is ``softcap_score(cap)``, 0.0 for None, None for any other score_mod."""
    if score_mod is None:
        return 0.0
    for cap in _constants(score_mod, float):
        if cap > 0 and score_mod == softcap_score(cap):
            return cap
    return None
