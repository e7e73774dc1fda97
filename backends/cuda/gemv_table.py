"""Measured launch configurations of the cuda backend's GEMV (``kernels/gemv_small_m.cu``), per GPU family and
problem, and whether each measured ahead of the triton backend's table in the same process.

Written by ``benchmarks/experiments/gemv_wide.py --write-table`` from the sweeps' JSON (every variant checked
against float64, then timed in CUDA graphs over weights rotated past 4x the L2, beside the triton table and
tinygemm); never by hand. ``quant_gemv.choose`` takes an entry when the problem has one and its rule otherwise; the
backend's priority hook (``__init__``) ranks it above triton for the problems whose entry says it won.

Keys name a GPU family (``"sm_90"``: serves every card of the family without entries of its own) or one card of it
(``"sm_90/h200"``: measured on that card, looked up first); ``--table-scope`` of ``write-table`` picks which.
Entries so far: the session-26 sweeps on an H100 (``benchmarks/results/gemv-wide-sweep-h100.json``, ``gemv-wide-sweep-m4-h100.json``),
written for the family sm_90 (``benchmarks/gemv_notes.md`` v26); the H100's own (``"sm_90/h100"``) from session 27's
deep-ring sweep of the N <= 6144 shapes and session 28's of the larger ones
(``gemv-wide-sweep-deep-small-n-h100.json``, ``gemv-wide-sweep-deep-large-n-h100.json``, v27 / v28); the H200's own (``"sm_90/h200"``) from session
28's sweep of every shape with every ring depth (``gemv-wide-sweep-h200.json``, v28).
"""

from __future__ import annotations

#: (family or family/card, M, bits, N, K) -> (quads, lanes, splits, pf, ldna, beats_triton);
#: family as ``quant_gemv.family``, card as ``quant_gemv.card``
TABLE: dict[tuple[str, int, int, int, int], tuple[int, int, int, int, int, bool]] = {
    ('sm_90', 1, 4, 4096, 4096): (16, 4, 8, 2, 1, False),
    ('sm_90', 1, 4, 4096, 14336): (32, 4, 14, 2, 1, False),
    ('sm_90', 1, 4, 6144, 4096): (32, 4, 8, 2, 1, False),
    ('sm_90', 1, 4, 8192, 8192): (32, 4, 4, 2, 1, True),
    ('sm_90', 1, 4, 14336, 4096): (32, 4, 4, 2, 1, True),
    ('sm_90', 1, 4, 16384, 16384): (32, 8, 8, 1, 0, True),
    ('sm_90', 1, 4, 28672, 4096): (32, 4, 4, 2, 1, True),
    ('sm_90', 1, 4, 28672, 8192): (32, 4, 8, 2, 1, True),
    ('sm_90', 1, 4, 128256, 4096): (32, 8, 1, 2, 0, True),
    ('sm_90', 1, 8, 8192, 8192): (32, 8, 8, 2, 1, True),
    ('sm_90', 1, 8, 16384, 16384): (16, 8, 16, 2, 1, False),
    ('sm_90', 1, 8, 28672, 8192): (16, 8, 4, 2, 1, True),
    ('sm_90', 4, 4, 4096, 4096): (32, 8, 8, 2, 0, False),
    ('sm_90', 4, 4, 4096, 14336): (32, 4, 8, 2, 1, False),
    ('sm_90', 4, 4, 8192, 8192): (32, 8, 4, 2, 0, False),
    ('sm_90', 4, 4, 14336, 4096): (32, 4, 4, 2, 1, False),
    ('sm_90', 4, 4, 16384, 16384): (32, 4, 16, 1, 0, False),
    ('sm_90', 4, 4, 28672, 8192): (32, 4, 8, 1, 0, False),
    ('sm_90/h100', 1, 4, 4096, 4096): (16, 4, 8, 2, 1, False),
    ('sm_90/h100', 1, 4, 4096, 14336): (32, 4, 8, 4, 1, False),
    ('sm_90/h100', 1, 4, 6144, 4096): (32, 4, 8, 2, 1, False),
    ('sm_90/h100', 1, 4, 8192, 8192): (32, 4, 8, 4, 1, True),
    ('sm_90/h100', 1, 4, 14336, 4096): (32, 4, 4, 4, 1, True),
    ('sm_90/h100', 1, 4, 16384, 16384): (32, 4, 4, 4, 1, True),
    ('sm_90/h100', 1, 4, 28672, 4096): (32, 4, 4, 2, 1, True),
    ('sm_90/h100', 1, 4, 28672, 8192): (16, 4, 4, 4, 1, True),
    ('sm_90/h100', 1, 4, 128256, 4096): (32, 8, 1, 2, 0, True),
    ('sm_90/h100', 1, 8, 8192, 8192): (16, 8, 4, 4, 1, True),
    ('sm_90/h100', 1, 8, 16384, 16384): (16, 8, 16, 2, 1, True),
    ('sm_90/h100', 1, 8, 28672, 8192): (16, 8, 4, 2, 1, True),
    ('sm_90/h200', 1, 4, 4096, 4096): (16, 4, 8, 2, 1, False),
    ('sm_90/h200', 1, 4, 4096, 14336): (32, 4, 14, 2, 1, True),
    ('sm_90/h200', 1, 4, 6144, 4096): (16, 8, 4, 2, 0, False),
    ('sm_90/h200', 1, 4, 8192, 8192): (32, 4, 8, 4, 1, True),
    ('sm_90/h200', 1, 4, 14336, 4096): (32, 4, 4, 4, 1, True),
    ('sm_90/h200', 1, 4, 16384, 16384): (32, 4, 4, 4, 1, True),
    ('sm_90/h200', 1, 4, 28672, 4096): (32, 4, 4, 2, 1, True),
    ('sm_90/h200', 1, 4, 28672, 8192): (32, 4, 8, 2, 1, True),
    ('sm_90/h200', 1, 4, 128256, 4096): (32, 4, 1, 1, 0, True),
    ('sm_90/h200', 1, 8, 8192, 8192): (16, 16, 8, 1, 0, True),
    ('sm_90/h200', 1, 8, 16384, 16384): (32, 8, 4, 1, 0, True),
    ('sm_90/h200', 1, 8, 28672, 8192): (32, 8, 8, 1, 0, True),
}
