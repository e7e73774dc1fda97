"""Measured launch configurations of the cuda backend's GEMV (``kernels/gemv_small_m.cu``), per GPU family and
problem, and whether each measured ahead of the triton backend's table in the same process.

Written by ``benchmarks/experiments/gemv_wide.py --write-table`` from the sweeps' JSON (every variant checked
against float64, then timed in CUDA graphs over weights rotated past 4x the L2, beside the triton table and
tinygemm); never by hand. ``quant_gemv.choose`` takes an entry when the problem has one and its rule otherwise; the
backend's priority hook (``__init__``) ranks it above triton for the problems whose entry says it won.

Empty until the first GPU sweep runs (``benchmarks/gemv_notes.md`` v26).
"""

from __future__ import annotations

#: (family, M, bits, N, K) -> (quads, lanes, splits, pf, ldna, beats_triton); family as ``quant_gemv.family``
TABLE: dict[tuple[str, int, int, int, int], tuple[int, int, int, int, int, bool]] = {}
