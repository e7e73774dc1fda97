"""Every tolerance of the suite, in one table, and the pass/fail check that applies them.

The rule (from the brief, the FlashAttention practice)::

    pass  iff  max|out - gold| <= factor * naive_err + floor
    floor      = abs_floor + rel_floor * max|gold|
    naive_err  = max|naive - gold|, the error of the same math in the storage dtype
                 (``conformance.naive``), stored per case in the golden manifest

plus, for quantized GEMV, ``NMSE = sum (out - gold)^2 / sum gold^2 <= nmse``; and for every op,
exactly: a NaN or Inf where the gold is finite fails, anything but NaN where the gold is NaN fails
(a poisoned input's row, ``docs/ir.md`` "Non-finite values"), and anything but the same infinity
where the gold is +inf or -inf fails (e.g. the LSE of a fully masked row). The error figures and
the NMSE are taken over the finite golds only. The attention LSE (``return_lse``) is checked by the
same rule with its own naive error and floors (rows ``"attention.lse"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rule:
    factor: float           # times the naive error
    abs_floor: float        # absolute floor
    rel_floor: float        # floor relative to max|gold|
    nmse: float | None = None


#: (op, storage dtype) -> Rule. Floors sit near one ulp of the storage dtype at max|gold|.
TABLE: dict[tuple[str, str], Rule] = {
    ("attention", "float32"): Rule(2.0, 2e-6, 4e-6),
    ("attention", "float16"): Rule(2.0, 1e-4, 2.0 ** -11),
    ("attention", "bfloat16"): Rule(2.0, 1e-3, 2.0 ** -8),
    ("attention.lse", "float32"): Rule(2.0, 1e-5, 2e-6),
    ("attention.lse", "float16"): Rule(2.0, 1e-3, 2.0 ** -11),
    ("attention.lse", "bfloat16"): Rule(2.0, 1e-2, 2.0 ** -8),
    ("quant_gemv", "float32"): Rule(2.0, 1e-6, 4e-6, nmse=1e-9),
    ("quant_gemv", "float16"): Rule(2.0, 1e-4, 2.0 ** -11, nmse=1e-5),
    ("quant_gemv", "bfloat16"): Rule(2.0, 1e-3, 2.0 ** -8, nmse=1e-4),
}

#: significant mantissa bits kept when a gold is stored, per storage dtype (float32 keeps all 23).
#: The rounding (2^-17 relative for fp16 cases, 2^-13 for bf16) is far below every floor above.
STORED_MANTISSA_BITS = {"float32": 23, "float16": 16, "bfloat16": 12}


def rule(op: str, dtype: str) -> Rule:
    return TABLE[(op, dtype)]


def bound(op: str, dtype: str, naive_err: float, gold_max: float) -> float:
    """The max-abs-error bound of a case."""
    r = TABLE[(op, dtype)]
    return r.factor * naive_err + r.abs_floor + r.rel_floor * gold_max


@dataclass
class Verdict:
    ok: bool
    max_abs_err: float
    tolerance: float
    reason: str = ""
    nmse: float | None = None


def compare(out: np.ndarray, gold: np.ndarray, tol: float, nmse_bound: float | None = None,
            what: str = "out") -> Verdict:
    """Check ``out`` against ``gold`` (float arrays of one shape) under ``tol`` and ``nmse_bound``."""
    out = np.asarray(out, dtype=np.float64)
    gold = np.asarray(gold, dtype=np.float64)
    if out.shape != gold.shape:
        return Verdict(False, float("inf"), tol, f"{what} has shape {out.shape}, expected {gold.shape}")
    gfin, ofin = np.isfinite(gold), np.isfinite(out)
    # NaN exactly where the gold is NaN, the same infinity where it is infinite, finite elsewhere
    bad = (gfin & ~ofin) | (np.isnan(gold) != np.isnan(out)) | (np.isinf(gold) & (out != gold))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        n = int(bad.sum())
        return Verdict(False, float("inf") if (gfin & ~ofin).any() else float("nan"), tol,
                       f"{what}{list(idx)} = {float(out[idx])} but the gold is {float(gold[idx])} "
                       f"({n} non-finite mismatch{'es' if n > 1 else ''})")
    if not gfin.any():
        return Verdict(True, 0.0, tol)
    full = np.zeros(gold.shape)
    full[gfin] = np.abs(out[gfin] - gold[gfin])
    diff = full[gfin]
    err = float(diff.max())
    g = gold[gfin]
    denom = float(np.sum(g * g))
    nmse = float(np.sum(diff * diff) / denom) if denom > 0 else 0.0
    if err > tol:
        where = tuple(int(i) for i in np.unravel_index(int(np.argmax(full)), gold.shape))
        return Verdict(False, err, tol, f"max |{what} - gold| = {err:.3g} at {list(where)} exceeds the "
                                        f"tolerance {tol:.3g} (out {out[where]:.6g}, gold {gold[where]:.6g})", nmse)
    if nmse_bound is not None and nmse > nmse_bound:
        return Verdict(False, err, tol, f"NMSE of {what} = {nmse:.3g} exceeds the bound {nmse_bound:.3g}", nmse)
    return Verdict(True, err, tol, "", nmse)


def trim_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 copy of ``x`` rounded to ``bits`` mantissa bits (ties to even); infs pass through."""
    x = np.asarray(x, dtype=np.float32)
    if bits >= 23:
        return x.copy()
    drop = 23 - bits
    u = x.view(np.uint32).astype(np.uint64)
    half = np.uint64((1 << (drop - 1)) - 1)
    odd = (u >> np.uint64(drop)) & np.uint64(1)
    r = ((u + half + odd) >> np.uint64(drop)) << np.uint64(drop)
    out = (r & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x)
