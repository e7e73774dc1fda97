"""Tuning data of the cuda backend: the measured launch configurations of its GEMV kernels (``TABLE``: the word
kernel ``kernels/gemv_small_m.cu``; ``FRAG_TABLE``: the fragment kernel ``kernels/gemv_frag.cu``).

Per GPU family and problem, the fastest launch variant a sweep found and whether it timed ahead of the triton
backend's table in the same run. Written by ``benchmarks/gemv_table_sweep.py --phase write-table`` from the sweeps'
JSON (every variant checked against float64, then timed in CUDA graphs over weights rotated past 4x the L2, beside
the triton table and tinygemm); never by hand. ``quant_gemv.choose`` takes an entry when the problem has one and its
rule otherwise; the backend's priority hook (``__init__``) ranks it above triton for the problems whose entry says
it won.

Keys name a GPU family (``"sm_90"``: serves every card of the family without entries of its own) or one card of it
(``"sm_90/h200"``: measured on that card, looked up first). Each entry's ``source`` names the result file under
``benchmarks/results/`` whose sweep measured it (``benchmarks/README.md`` says which command made each file, on which
device and commit): the family ``sm_90`` from the H100 sweeps at M = 1 and M = 4, the H100's own entries from its
deep-ring sweeps (N <= 6144, and the larger shapes), the H200's own from its sweep of every shape and ring depth.
"""

from __future__ import annotations

from typing import NamedTuple


class GemvEntry(NamedTuple):
    """One measured launch configuration (the fields of ``quant_gemv.SmallMConfig``, then the verdict and its
    evidence)."""

    quads: int              #: column quads per CTA (4 columns each)
    lanes: int              #: row lanes per column quad
    splits: int             #: K slices (each holds whole groups)
    pf: int                 #: groups in flight per lane (the ring depth)
    ldna: int               #: 1: non-allocating loads of the weight
    beats_triton: bool      #: timed ahead of the triton table in the same run: the priority hook ranks cuda first
    source: str             #: the result file under benchmarks/results/ that measured it


#: (family or family/card, M, bits, N, K) -> GemvEntry; family as ``quant_gemv.family``, card as
#: ``quant_gemv.card``
TABLE: dict[tuple[str, int, int, int, int], GemvEntry] = {
    ('sm_90', 1, 4, 4096, 4096): GemvEntry(16, 4, 8, 2, 1, False, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 4096, 14336): GemvEntry(32, 4, 14, 2, 1, False, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 6144, 4096): GemvEntry(32, 4, 8, 2, 1, False, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 8192, 8192): GemvEntry(32, 4, 4, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 14336, 4096): GemvEntry(32, 4, 4, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 16384, 16384): GemvEntry(32, 8, 8, 1, 0, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 28672, 4096): GemvEntry(32, 4, 4, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 28672, 8192): GemvEntry(32, 4, 8, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 4, 128256, 4096): GemvEntry(32, 8, 1, 2, 0, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 8, 8192, 8192): GemvEntry(32, 8, 8, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 8, 16384, 16384): GemvEntry(16, 8, 16, 2, 1, False, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 1, 8, 28672, 8192): GemvEntry(16, 8, 4, 2, 1, True, 'gemv-wide-sweep-h100.json'),
    ('sm_90', 4, 4, 4096, 4096): GemvEntry(32, 8, 8, 2, 0, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90', 4, 4, 4096, 14336): GemvEntry(32, 4, 8, 2, 1, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90', 4, 4, 8192, 8192): GemvEntry(32, 8, 4, 2, 0, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90', 4, 4, 14336, 4096): GemvEntry(32, 4, 4, 2, 1, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90', 4, 4, 16384, 16384): GemvEntry(32, 4, 16, 1, 0, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90', 4, 4, 28672, 8192): GemvEntry(32, 4, 8, 1, 0, False, 'gemv-wide-sweep-m4-h100.json'),
    ('sm_90/h100', 1, 4, 4096, 4096): GemvEntry(16, 4, 8, 2, 1, False, 'gemv-wide-sweep-deep-small-n-h100.json'),
    ('sm_90/h100', 1, 4, 4096, 14336): GemvEntry(32, 4, 8, 4, 1, False, 'gemv-wide-sweep-deep-small-n-h100.json'),
    ('sm_90/h100', 1, 4, 6144, 4096): GemvEntry(32, 4, 8, 2, 1, False, 'gemv-wide-sweep-deep-small-n-h100.json'),
    ('sm_90/h100', 1, 4, 8192, 8192): GemvEntry(32, 4, 8, 4, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 4, 14336, 4096): GemvEntry(32, 4, 4, 4, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 4, 16384, 16384): GemvEntry(32, 4, 4, 4, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 4, 28672, 4096): GemvEntry(32, 4, 4, 2, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 4, 28672, 8192): GemvEntry(16, 4, 4, 4, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 4, 128256, 4096): GemvEntry(32, 8, 1, 2, 0, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 8, 8192, 8192): GemvEntry(16, 8, 4, 4, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 8, 16384, 16384): GemvEntry(16, 8, 16, 2, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h100', 1, 8, 28672, 8192): GemvEntry(16, 8, 4, 2, 1, True, 'gemv-wide-sweep-deep-large-n-h100.json'),
    ('sm_90/h200', 1, 4, 4096, 4096): GemvEntry(16, 4, 8, 2, 1, False, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 4096, 14336): GemvEntry(32, 4, 14, 2, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 6144, 4096): GemvEntry(16, 8, 4, 2, 0, False, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 8192, 8192): GemvEntry(32, 4, 8, 4, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 14336, 4096): GemvEntry(32, 4, 4, 4, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 16384, 16384): GemvEntry(32, 4, 4, 4, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 28672, 4096): GemvEntry(32, 4, 4, 2, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 28672, 8192): GemvEntry(32, 4, 8, 2, 1, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 4, 128256, 4096): GemvEntry(32, 4, 1, 1, 0, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 8, 8192, 8192): GemvEntry(16, 16, 8, 1, 0, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 8, 16384, 16384): GemvEntry(32, 8, 4, 1, 0, True, 'gemv-wide-sweep-h200.json'),
    ('sm_90/h200', 1, 8, 28672, 8192): GemvEntry(32, 8, 8, 1, 0, True, 'gemv-wide-sweep-h200.json'),
}


class AttentionEntry(NamedTuple):
    """A measured attention problem class where the CuTe DSL kernel (``attention.py``) timed ahead of triton."""

    source: str             #: the result file under benchmarks/results/ that measured it


#: (family or family/card, dtype, head_dim, masked) -> AttentionEntry. Empty: the CuTe DSL attention kernel passes the
#: gpu-tier conformance cases it supports on an H100 but runs at 0.80-0.83x of triton's prefill there
#: (benchmarks/results/attention-cute-first-run-h100.json), so the backend's priority hook never ranks its attention
#: above triton (``portakern_backend_priority`` in ``__init__``); ``backend="cuda"`` reaches it.
ATTENTION_TABLE: dict[tuple[str, str, int, bool], AttentionEntry] = {}


class FragEntry(NamedTuple):
    """One measured launch of the fragment kernel (the fields of ``quant_gemv.FragConfig``) and its evidence."""

    rw: int                 #: row warps (16 nt rw rows per CTA)
    nt: int                 #: 16-row tiles per warp
    kw: int                 #: K warps
    splits: int             #: K slices
    pf: int                 #: 128-column chunks in flight per thread
    ldna: int               #: 1: non-allocating loads of the weight
    source: str             #: the result file under benchmarks/results/ that measured it


#: (family or family/card, M, N, K) -> FragEntry for int4 weights held only as fragments: the fastest variant of
#: ``benchmarks/gemv_table_sweep.py --kernel frag --phase bench`` (every variant checked against float64, timed in CUDA
#: graphs over weights rotated past 4x the L2), kept where it beat the word kernel's entry translated
#: (``quant_gemv.frag_config``, the fallback) by more than 2% in the same run; lookup as ``TABLE``'s.
FRAG_TABLE: dict[tuple[str, int, int, int], FragEntry] = {
    ('sm_90/h100', 1, 4096, 4096): FragEntry(4, 2, 2, 8, 1, 1, 'gemv-cuda-frag-sweep-h100.json'),
    ('sm_90/h100', 1, 4096, 14336): FragEntry(2, 2, 2, 8, 2, 1, 'gemv-cuda-frag-sweep-h100.json'),
    ('sm_90/h100', 1, 8192, 8192): FragEntry(4, 2, 2, 8, 1, 1, 'gemv-cuda-frag-sweep-h100.json'),
    ('sm_90/h100', 1, 14336, 4096): FragEntry(2, 2, 2, 4, 1, 1, 'gemv-cuda-frag-sweep-h100.json'),
    ('sm_90/h100', 1, 16384, 16384): FragEntry(4, 2, 2, 4, 1, 1, 'gemv-cuda-frag-sweep-h100.json'),
    ('sm_90/h100', 1, 28672, 8192): FragEntry(8, 1, 1, 1, 4, 1, 'gemv-cuda-frag-sweep-h100.json'),
}
