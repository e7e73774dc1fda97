"""Launch configurations for the quantized GEMV kernels: a per-arch table, and optional autotuning.

``choose(layout, M, N, dtype, arch, num_sms)`` returns a ``GemvConfig``. The table is keyed by the
architecture family:

==========  ===========================================================================
arch        source of the numbers
==========  ===========================================================================
sm_90       H200 sweeps (sessions 1-5) in ``benchmarks/gemv_notes.md`` (``benchmarks/gemv.py --sweep``)
sm_80       the sm_90 choices without ``pdl`` (sm_90+); not measured
sm_100      the sm_90 choices (not measured here)
sm_120      the sm_90 choices (not measured here)
interp      Triton's CPU interpreter: small tiles so tests cross tile, group and split edges
==========  ===========================================================================

With ``PORTAKERN_TRITON_AUTOTUNE=1`` the first call of a problem bucket times ``candidates()`` on
the device and keeps the fastest in ``portakern.cache.TuningCache`` (device identity, portakern
and Triton versions, bucket); a later process reads it back without timing.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass, replace

from .tuning import PDL_ARCHS, check_pdl  # noqa: F401  (check_pdl: shared with attention)

#: Multiprocessors assumed when lowering for a target without the device.
DEFAULT_SMS = {"sm_80": 108, "sm_90": 132, "sm_100": 148, "sm_120": 84, "interp": 4}
#: Largest M served by the CUDA-core kernel; larger M goes to the tensor-core kernel. H200 run 1:
#: at M=4 the CUDA-core kernel's 3-D (M, K, N) tiles ran 2x slower than the tensor-core kernel.
#: The interpreter keeps 2 so that tests cover the CUDA-core kernel's multi-row path.
FMA_MAX_M = {"sm_80": 1, "sm_90": 1, "sm_100": 1, "sm_120": 1, "interp": 2}
#: Split K until the grid holds this many programs per multiprocessor (bounded by MAX_SPLIT_K), per
#: kernel kind. H200 session 2: the tensor-core kernel at 28672x8192 ran fastest unsplit (224 column
#: tiles: M=16 155 us vs 169 us with 4 slices), so it splits only to fill each SM once. H200 session 5:
#: the "mma" kernel's sweep winners held 3.9 (4096 x 14336, 4096^2: 8 slices of 64 tiles) and 6.8
#: (28672 x 8192: 2 slices of 448 tiles, 77.9 us vs 128.8 unsplit) programs per SM.
PROGRAMS_PER_SM = {"fma": 4, "dot": 1, "mma": 3.5, "frag": 27, "stream": 2}
MAX_SPLIT_K = 8
#: The CUDA-core kernel's per-word-row programs of more than this many warps count as several toward
#: PROGRAMS_PER_SM["fma"] (the 8-warp tile the table takes from N = 16384 as two). H200 session 16, int8 16384^2
#: (512 tiles of 32 columns, 8 warps): unsplit 69.0 us against 76.6 with the two slices a count of programs gave
#: (``results/gemv-int8-sweep-h200.json``)
FMA_PROGRAM_WARPS = 4
#: Group-resident tiles (``GemvConfig.group_rows``) run few warps per program over wide column
#: tiles: split K until the grid holds this many warps per multiprocessor, up to MAX_SPLIT_K_ROWS.
WARPS_PER_SM_ROWS = 14
MAX_SPLIT_K_ROWS = 32
#: The sm_80+ tables use group-resident tiles at M=1 above this N * K (codes) (H200 session 4: at
#: 4096 x 4096 the per-word-row tile was faster, 6.5 vs 6.8 us; at 6144 x 4096 slower, 9.8 vs 8.4).
ROWS_MIN_NK = 1 << 24
#: Families whose int4 M=1 table takes the per-word-row tile of 64 columns x 32 word rows (4 warps) instead of
#: group-resident tiles below STREAM_MIN_N (the decode step's down projection, 4096 x 14336). H200 session 17:
#: the Llama-3-8B-shaped step with that GEMV alternated five times with the table's group-resident tile (same
#: process and weights, ``results/decode-step-down-ab-h200.json``) ran 2.267-2.277 ms against
#: 2.277-2.324 at ctx 2048 and 2.489-2.498 against 2.494-2.540 at 8192 (the group-resident step fast only in its
#: first round); alone, in graphs of back-to-back calls, the two tie (13.8-14.3 us in sessions 3-4, 14.1 in 16)
SMALL_N_WORD_ROWS_ARCHS = ("sm_90",)
#: int8 M=1 tables use group-resident tiles (512 columns, 2 warps, 16 word rows) for ROWS_MIN_NK < N * K <=
#: ROWS_INT8_MAX_NK. H200 session 16 sweep (``results/gemv-int8-sweep-h200.json``, 206 configurations
#: over three shapes): 8192^2 22.2 us against 24.0 for the per-word-row table tile (74% vs 68% of the floor);
#: above it the per-word-row tile stays (28672x8192 64.0 vs 67.7 us for this tile at its automatic split, 16384^2
#: 69.0 vs 70.0; the best there, 63.4 and 68.3, differ from the table by less than the sweep's noise)
ROWS_INT8_MAX_NK = 1 << 26
#: Shortest K slice (word rows) of a split with group-resident tiles (H200 session 4: 14336x4096
#: 13.5 us with 32-row slices vs 14.0 with 16; 4096x14336 14.3 us with 56 vs 18.8 with 112)
ROWS_MIN_SLICE_WORDS = 32


#: Kind "frag" (``kernels/gemv_frag.py``, bf16 x, M <= 16, weights with a fragment layout). H200
#: session 7 sweep (``benchmarks/gemv_notes.md`` v9, 7 shapes, M = 1 and 16): 64-row programs (2 warps
#: x 2 units) won or tied at M=16 everywhere but the 128256-row head (256 rows, 4 warps x 4 units:
#: 98.3 vs 105.3 us); K split until the grid holds FRAG_PROGRAMS_PER_SM programs per SM (M <= 8:
#: ~27; M > 8: ~6.8, the two MMAs per step make programs heavier) with at least FRAG_MIN_CHUNKS
#: 128-column chunks per slice (4096^2 at M=16: 9.7 us with 8 slices of 4 chunks, 13.4 with 16 of 2)
FRAG_PROGRAMS_PER_SM = {8: 27, 16: 6.8}
FRAG_MIN_CHUNKS = {8: 2, 16: 4}
FRAG_MAX_SPLIT = 16
#: From this N on the "frag" table takes 256-row programs (the LM head)
FRAG_WIDE_MIN_N = 65536
#: Above 8 rows of x and from this N * K on, 128-row programs (4 warps x 2 units): H200 session 7 sweeps
#: at 16384^2, M=16: 58.4 / 61.4 us with 4 slices (two sweeps) against 66.2 for the 64-row entry in
#: the bench; set from the sweeps, not yet re-benched as the table's choice
FRAG_TALL_MIN_NK = 1 << 28
#: The "frag" tables launch it as a programmatic dependent (sm_90+). H200 session 21 sweep
#: (``results/gemv-frag-sweep-h200.json``, M = 4 and 16, six shapes, each candidate with and without):
#: with PDL best or within noise on 10 of 12 (M=4 4096^2 7.10 vs 7.90 us, 14336x4096 14.22 vs 14.64, 28672x8192
#: 39.97 vs 41.15; M=16 4096^2 9.36 vs 10.16, 8192^2 18.13 vs 18.98), 0.3-0.45 us behind at M=4 4096x14336 and
#: 8192^2
FRAG_PDL = True
#: The "frag" kernel's split-K merge (``kernels/gemv_frag.py``, ``MERGE``): 0, the last slice to arrive adds the
#: partials; 1, the grid's last slice does (the others leave without reading the count back). Session 21 anatomy:
#: the merge costs 2.1-3.3 us at N * K <= 2^26. ``experiments/merge_ab.py`` (H100 session 23,
#: ``results/merge-ab-h100.json``, bit-equal on all eight rows): 1 faster on six, by 0.37-0.92 us (all
#: four M=16 rows, M=4 14336x4096 and 8192^2), 0.16 / 0.31 us slower at M=4 4096x14336 / 4096^2. Taken only up to
#: ``SPLIT_MERGE_MAX_NK``: the table's M=16 28672x8192 row, not in that run, went from 53.9 to 71.8 us with it in the
#: same session's bench (``results/gemv-merge-last-slice-h100.json``; the merging slices all run in the last
#: wave of a grid of several)
FRAG_MERGE = 1
SPLIT_MERGE_MAX_NK = 1 << 26
#: The same choice for the CUDA-core kernel ("fma", ``kernels/gemv_quant._finish``; compiled kernels only: the
#: merging slice polls, which the interpreter's one-program-at-a-time run would not let finish in order). Same
#: H100 session-23 run: 1 faster on all four split rows (M=1 4096^2 / 4096x14336 int4, 8192^2 / 4096^2 int8) by
#: 0.11-0.59 us, bit-equal
GEMV_MERGE = 1


def split_merge(kind: str, N: int, K: int) -> int:
    """The ``MERGE`` constexpr of a "frag" or "fma" kernel for an (N, K) weight: the kind's switch (``FRAG_MERGE``,
    ``GEMV_MERGE``) up to ``SPLIT_MERGE_MAX_NK`` elements, 0 (the last slice to arrive merges) above, where a grid of
    several waves leaves every merging slice to the last one (measured for "frag"; no "fma" row that large splits
    K in the sm_90 table, and none was timed)."""
    switch = {"frag": FRAG_MERGE, "fma": GEMV_MERGE}[kind]
    return switch if N * K <= SPLIT_MERGE_MAX_NK else 0


#: M=1 stays on the CUDA-core kernel: the "frag" kernel tied it within ~3% (H200 session 7: 28672x8192
#: 37.8 vs 38.7 us, 4096^2 7.0 vs 6.3), and the CUDA-core kernel serves every format and dtype
FRAG_MIN_M = 2


#: Kind "stream" (``kernels/gemv_stream.py``, M = 1 int4, Gluon): H200 session 11 (``benchmarks/gemv_notes.md``
#: v12) at M=1, 256 columns, 8 warps, one unit ahead, two programs per SM, pdl, against the group-resident
#: "fma" entry: 28672x8192 36.4-37.1 vs 38.7 us, 16384^2 40.7-41.2 vs 43.3, 128256x4096 79.2 vs 84.7,
#: 28672x4096 20.5-20.9 vs 22.4, 14336x4096 12.9 vs 13.4, 6144x4096 7.8 vs 8.5, 8192^2 a tie (14.5 vs 14.4),
#: slower at N = 4096 (4096^2 7.1 vs 6.3, 4096x14336 15.3 vs 14.1): the sm_90 table takes it from this N
STREAM_MIN_N = 6144
#: The architectures whose table takes kind "stream" (measured there; the kernel lowers for sm_80 and later)
STREAM_ARCHS = ("sm_90",)


#: Dequantization variants the kernels implement (``GemvConfig.dq``, ``kernels.gemv_quant._codes``).
DQ_VARIANTS = (0, 1, 2, 3)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration.

    kind       "fma" (CUDA cores, small M), "dot" (tensor cores, M tile of 16), "mma" (tensor cores,
               int4 with one group per K tile: codes dequantized as 16-bit pairs, scales applied
               after the MMA; ``mma_eligible``), "frag" (tensor cores, int4 words in the MMA's
               fragment layout, bf16 x, M <= 16; ``frag_usable``; Gluon) or "stream" (CUDA cores,
               int4, M = 1, a stream-K grid of ``per_sm`` programs per SM; ``stream_usable``; Gluon)
    block_n    rows of W per program ("frag": 16 x num_warps x units per warp; "stream": 128 or 256,
               with 4 warps per 128)
    block_kw   32-bit words of K per row and iteration (8 int4 or 4 int8 codes each)
    num_warps  Triton launch option
    num_stages Triton launch option; for kind "fma", > 1 streams the word tiles through Triton's
               software pipeliner (shared memory) instead of the register prefetch (H200: slower,
               see benchmarks/gemv_notes.md v5; in no table)
    split_k    slices of K (1: each program covers all of K)
    dq         dequantization variant of ``kernels.gemv_quant._codes`` (``DQ_VARIANTS``); 3 (subnormal
               codes, the GPU tables' choice for the CUDA-core kernel; the tensor-core kernel and
               per-element groups run it as 2)
    swap_ab    (tensor-core kernel) dequantized weights as the MMA's A operand, x as B
    prefetch   (CUDA-core kernels: "fma" with num_stages 1, "stream") tiles of words loaded ahead into
               registers: 1 or 2 ("fma", H200 session 3: 2 slower on every swept shape; "stream",
               session 11: 1 and 2 within 2%)
    pdl        programmatic dependent launch (sm_90+, compiled kernels only): the kernel may start
               while the previous kernel in the stream drains; it requests its first weight tiles,
               then waits for that kernel (``griddepcontrol.wait``) before touching x or the output.
               The GPU tables' choice for the CUDA-core, stream and "frag" kernels ("frag": its first
               chunk's words, scales and zeros before the wait; ``FRAG_PDL``)
    group_rows (CUDA-core kernel) every K tile lies in one quantization group (``fit`` caps block_kw
               at the words per group) and each thread holds all of its rows: the products are
               summed over the rows in registers and scaled once per tile and column instead of
               once per word. block_n is then a multiple of 128 per warp (one 16-byte vector of
               each row per thread). Ignored (cleared by ``fit``) for per-element groups
    x_runs     (kind "mma") x read as it lies in runs of 8 columns, one MMA per code position, instead
               of one tile per group re-laid in registers (``kernels.gemv_mma.gemv_mma_kernel``)
    per_sm     (kind "stream") programs per multiprocessor
    l2_prefetch (kind "stream") units of words past those loaded into registers that each program asks
               the L2 to fetch (one ``prefetch.global.L2`` per 128-byte line) before it waits for the
               previous kernel (``pdl``): DRAM works while that kernel finishes. 0 to 8; 0: none. In no
               table: H200 session 15, decode step at ctx 2048, 2 and 4 units 2.396 / 2.408 ms against
               2.309 without (same process and weights, bit-equal logits; benchmarks/gemv_notes.md v14)
    """

    kind: str
    block_n: int
    block_kw: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    dq: int = 2
    swap_ab: bool = False
    prefetch: int = 1
    pdl: bool = False
    group_rows: bool = False
    x_runs: bool = False
    per_sm: int = 2
    l2_prefetch: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def arch_family(cc: tuple[int, int] | int | None) -> str:
    """"sm_80" | "sm_90" | "sm_100" | "sm_120" from a compute capability ((9, 0) or 90)."""
    if cc is None:
        return "interp"
    major = cc[0] if isinstance(cc, tuple) else int(cc) // 10
    if major >= 12:
        return "sm_120"
    if major >= 10:
        return "sm_100"
    if major >= 9:
        return "sm_90"
    return "sm_80"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_m(kind: str, M: int) -> int:
    """Rows of x per program: all of M up to 4 (CUDA cores), 8 or 16 columns of the "frag" kernel's
    MMA result, a 16-row MMA tile (other tensor-core kernels)."""
    if kind == "frag":
        return 8 if M <= 8 else 16
    return min(next_pow2(M), 4) if kind == "fma" else 16


def _table(arch: str, kind: str, M: int, N: int, K: int, bits: int, rows_ok: bool = False) -> GemvConfig:
    """The hand table: a (block_kw, block_n) word tile gives each thread 4 16-byte loads (group-
    resident tiles: 8 rows of 4 columns). ``rows_ok``: the layout has whole-word regular groups and
    no act-order permutation (what the group-resident sweep measured)."""
    if arch == "interp":
        return (GemvConfig("fma", block_n=8, block_kw=8, num_warps=1) if kind == "fma"
                else GemvConfig(kind, block_n=16, block_kw=16, num_warps=1))
    if kind == "frag":
        pdl = arch in PDL_ARCHS and FRAG_PDL
        if N >= FRAG_WIDE_MIN_N:
            return GemvConfig("frag", block_n=256, block_kw=32, num_warps=4, pdl=pdl)
        if M > 8 and N * K >= FRAG_TALL_MIN_NK:
            return GemvConfig("frag", block_n=128, block_kw=32, num_warps=4, pdl=pdl)
        return GemvConfig("frag", block_n=64, block_kw=32, num_warps=2, pdl=pdl)
    if kind == "mma":
        # H200 session 5 (M=16, benchmarks/gemv_notes.md v7): 64 columns and 4 warps beat 128 and 8 on
        # every shape; x read in runs won 4096x14336 (24.3 vs 32.0 us) and 4096^2 (11.2 vs 13.3), the
        # register-split x tile without pipelining won 28672x8192 (77.9 vs 83.8; "dot" 155). Session 6:
        # at 16384^2 the same x path over 128 columns (4 slices) ran 86.4 us vs 124 with 64 columns
        if N * K >= MMA_WIDE_MIN_NK:
            return GemvConfig("mma", block_n=128, block_kw=16, num_warps=4, num_stages=1)
        if N * K >= MMA_TILE_X_MIN_NK:
            return GemvConfig("mma", block_n=64, block_kw=16, num_warps=4, num_stages=1)
        return GemvConfig("mma", block_n=64, block_kw=16, num_warps=4, num_stages=3, x_runs=True)
    if kind == "fma" and rows_ok and M == 1 and bits == 8 and ROWS_MIN_NK < N * K <= ROWS_INT8_MAX_NK:
        return GemvConfig("fma", block_n=512, block_kw=16, num_warps=2, num_stages=1, dq=3, pdl=arch in PDL_ARCHS,
                          group_rows=True)
    if kind == "fma" and rows_ok and M == 1 and bits == 4 and N * K > ROWS_MIN_NK and N < STREAM_MIN_N \
            and arch in SMALL_N_WORD_ROWS_ARCHS:
        return GemvConfig("fma", block_n=64, block_kw=32, num_warps=4, num_stages=1, dq=3, pdl=arch in PDL_ARCHS)
    if kind == "fma" and rows_ok and M == 1 and bits == 4 and N * K > ROWS_MIN_NK:
        # H200 session 4 (benchmarks/gemv_notes.md, v6): group-resident tiles of 8 rows x 256 columns,
        # 2 warps, won every int4 M=1 shape but the smallest (28672x8192 38.9 vs 43.2 us for the best
        # per-word-row tile, 16384^2 43.5 vs 47.8, 8192^2 14.5 vs 17.0, 6144x4096 8.4 vs 9.8, 128256x4096
        # 82.8 vs 91.1; 4096^2 6.8 vs 6.5); 16 rows when N < 8192 (4096x14336: 14.3 vs 15.9 us with 8,
        # 6144x4096 8.4 vs 9.4; 8192^2 a tie)
        return GemvConfig("fma", block_n=256, block_kw=16 if N < 8192 else 8, num_warps=2, num_stages=1, dq=3,
                          pdl=arch in PDL_ARCHS, group_rows=True)
    if kind == "fma":
        # H200 run 1: (32, 64) won every M=1 shape, 8 warps when N fills the chip; session 2: the
        # subnormal dequantization (dq=3) beat dq=2 on every swept shape (28672x8192: 40.9 vs 49 us);
        # session 3: programmatic dependent launch won every M=1 shape in a graph of back-to-back
        # calls (4096^2 6.4 vs 7.5 us, 4096x14336 13.8 vs 15.0, 28672x8192 39.9 vs 40.7)
        return GemvConfig("fma", block_n=32, block_kw=64, num_warps=8 if N >= 16384 else 4, num_stages=1, dq=3,
                          pdl=arch in PDL_ARCHS)
    # session 3: pdl did not help the tensor-core kernel (M=16 28672x8192: 175 vs 155 us), so it stays off
    # session 2: M=16 with swapped operands 10-16% faster (28672x8192: 155 vs 171 us); M=4 not
    return GemvConfig("dot", block_n=128, block_kw=32, num_warps=4, num_stages=2, swap_ab=M > 4)


def split_k_for(N: int, KWP: int, cfg: GemvConfig, num_sms: int) -> int:
    """Slices of K so that ``cdiv(N, block_n) * split_k`` reaches PROGRAMS_PER_SM[kind] per SM (a CUDA-core
    program of 8 warps counts as two: FMA_PROGRAM_WARPS; group-resident tiles count warps: WARPS_PER_SM_ROWS),
    keeping at least two K tiles per slice."""
    tiles_n = math.ceil(N / cfg.block_n)
    iters = math.ceil(KWP / cfg.block_kw)
    if cfg.kind == "frag":   # block_kw 32 words = one 128-column chunk; M is not known here: see frag_split
        raise ValueError("split_k_for(kind='frag'): use frag_split(N, K, cfg, M, num_sms)")
    if cfg.group_rows:   # count warps (these programs are small); slices of at least ROWS_MIN_SLICE_WORDS
        per_split, want, most = tiles_n * cfg.num_warps, WARPS_PER_SM_ROWS * num_sms, MAX_SPLIT_K_ROWS
        room = KWP // ROWS_MIN_SLICE_WORDS
    else:
        weight = max(1, cfg.num_warps // FMA_PROGRAM_WARPS) if cfg.kind == "fma" else 1
        per_split, want, most = tiles_n * weight, PROGRAMS_PER_SM[cfg.kind] * num_sms, MAX_SPLIT_K
        room = iters // 2
    split = 1
    while per_split * split < want and split * 2 <= most and room >= split * 2:
        split *= 2
    return split


def frag_split(N: int, K: int, cfg: GemvConfig, M: int, num_sms: int) -> int:
    """Slices of K for kind "frag": a power of two up to FRAG_MAX_SPLIT while the grid stays within
    FRAG_PROGRAMS_PER_SM programs per SM and every slice keeps FRAG_MIN_CHUNKS chunks."""
    bm = block_m("frag", M)
    tiles_n = math.ceil(N / cfg.block_n)
    chunks = math.ceil(K / 128)
    want = FRAG_PROGRAMS_PER_SM[bm] * num_sms
    split = 1
    while (split * 2 <= FRAG_MAX_SPLIT and tiles_n * split * 2 <= want
           and chunks >= FRAG_MIN_CHUNKS[bm] * split * 2):
        split *= 2
    return split


def frag_usable(layout, M: int, dtype: str | None = None) -> str | None:
    """Why kind "frag" cannot serve ``layout`` at ``M`` rows of ``dtype`` x, or None if it can.
    ``dtype`` None (a forced configuration's check) accepts any: the kernel itself is bf16-only, so
    ``fit`` refuses other dtypes where the op is known (``quant_gemv.compile``)."""
    if getattr(layout, "frag", None) is None:
        return ("the prepared weight has no fragment layout (int4, groups a multiple of 128, no act-order, "
                "prepared for a CUDA device)")
    if M > 16:
        return f"M={M} (the kernel holds at most 16 rows of x)"
    if dtype is not None and dtype != "bfloat16":
        return f"dtype={dtype} (bf16 activations only: the dequantized codes are bf16 MMA operands)"
    return None


def stream_usable(layout, M: int, dtype: str | None = None) -> str | None:
    """Why kind "stream" cannot serve ``layout`` at ``M`` rows of ``dtype`` x, or None if it can (the
    kernel's own rules: ``gemv_stream.usable``)."""
    from .gemv_stream import usable

    return usable(layout, M, dtype)


def _fit_stream(cfg: GemvConfig, layout, M: int) -> GemvConfig:
    """``fit`` for kind "stream": 128 or 256 columns with 4 warps per 128, one or two units ahead, 1 to 4
    programs per SM; one group per unit (block_kw: the group's words)."""
    why = stream_usable(layout, M)
    if why is not None:
        raise ValueError(f"GemvConfig(kind='stream') cannot serve this weight: {why}; use kind='fma'")
    if not 0 <= cfg.l2_prefetch <= 8:
        raise ValueError(f"GemvConfig(l2_prefetch={cfg.l2_prefetch!r}): the stream kernel prefetches 0 to 8 units "
                         f"into the L2; use a value in that range")
    bn = 128 if cfg.block_n <= 128 else 256
    return replace(cfg, block_n=bn, num_warps=bn // 32, block_kw=layout.group_size // 8, num_stages=1, split_k=1,
                   dq=3, swap_ab=False, prefetch=min(max(cfg.prefetch, 1), 2), group_rows=False, x_runs=False,
                   per_sm=min(max(cfg.per_sm, 1), 4))


def _fit_frag(cfg: GemvConfig, layout, M: int) -> GemvConfig:
    """``fit`` for kind "frag": 1, 2, 4 or 8 warps of 1, 2 or 4 units (16 rows each) per program,
    at most 256 rows, dividing the padded rows ``stride_qk``; one chunk (32 words) per step."""
    why = frag_usable(layout, M)
    if why is not None:
        raise ValueError(f"GemvConfig(kind='frag') cannot serve this weight: {why}; use kind='mma' or 'dot'")
    w = min(max(1, next_pow2(cfg.num_warps)), 8)
    bn = min(max(16 * w, next_pow2(cfg.block_n)), 256, 64 * w)
    while layout.stride_qk % bn:
        bn //= 2
        w = min(w, bn // 16)
    return replace(cfg, block_n=bn, num_warps=w, block_kw=32, num_stages=1, dq=2, swap_ab=False, prefetch=1,
                   group_rows=False, x_runs=False)


def fit(cfg: GemvConfig, layout, M: int) -> GemvConfig:
    """Make ``cfg`` legal: power-of-two tiles, K tile within the padded rows (a multiple of 64).
    An unknown ``dq`` is an error (it would silently run another variant)."""
    if cfg.dq not in DQ_VARIANTS:
        raise ValueError(f"GemvConfig(dq={cfg.dq!r}): the gemv kernels implement dq in {DQ_VARIANTS}")
    if cfg.prefetch not in (1, 2) or (cfg.prefetch == 2 and cfg.kind not in ("fma", "stream")):
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, prefetch={cfg.prefetch!r}): prefetch is 1, or 2 for the "
                         f"CUDA-core kernels (kind='fma' or 'stream'); use prefetch=1")
    if cfg.x_runs and cfg.kind != "mma":
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, x_runs=True): x_runs is an option of the 'mma' kernel; "
                         f"use kind='mma' or x_runs=False")
    if cfg.swap_ab and cfg.kind != "dot":
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, swap_ab=True): swap_ab is an option of the tensor-core "
                         f"kernel; use kind='dot' or swap_ab=False")
    if cfg.group_rows and (cfg.kind != "fma" or cfg.prefetch != 1):
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, prefetch={cfg.prefetch}, group_rows=True): group_rows is an "
                         f"option of the CUDA-core kernel (kind='fma') with prefetch=1; use group_rows=False")
    if cfg.kind not in PROGRAMS_PER_SM:
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}): the kinds are {', '.join(PROGRAMS_PER_SM)}")
    if cfg.l2_prefetch and cfg.kind != "stream":
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, l2_prefetch={cfg.l2_prefetch}): l2_prefetch is an option of "
                         f"the stream kernel; use kind='stream' or l2_prefetch=0")
    if cfg.kind == "frag":
        return _fit_frag(cfg, layout, M)
    if cfg.kind == "stream":
        return _fit_stream(cfg, layout, M)
    if cfg.kind == "mma":
        why = mma_eligible(layout)
        if why is not None:
            raise ValueError(f"GemvConfig(kind='mma') cannot serve this weight: {why}; use kind='dot'")
        return _fit_mma(cfg, layout)
    bkw = min(next_pow2(cfg.block_kw), 64)
    bn = next_pow2(cfg.block_n)
    if cfg.kind == "dot":  # MMA needs 16 along K and N
        bkw, bn = max(16, bkw), max(16, bn)
    group_rows = cfg.group_rows and not layout.per_elem_group
    if group_rows:   # tiles within one group: the largest power of two dividing the words per group
        wpg = layout.group_size // layout.codes_per_word
        bkw = min(bkw, wpg & -wpg)
    else:            # tiles of at most 128 columns divide the padded row length (no column mask)
        bn = min(bn, 128)
    return replace(cfg, block_kw=bkw, block_n=bn, group_rows=group_rows)


#: Largest K tile of the "mma" kernel (word rows; a tile never leaves its group).
MMA_MAX_BKW = 32
#: From this N * K on, the "mma" table reads x as one tile per group (``GemvConfig.x_runs`` False).
MMA_TILE_X_MIN_NK = 1 << 27
#: From this N * K on, the "mma" table takes 128-column programs (H200 session 6: the one bench shape
#: there, 16384^2, M=16: 86.4 us vs 124 with 64 columns; 28672x8192, below it, keeps 64: 77.9 vs 87.3).
MMA_WIDE_MIN_NK = 1 << 28


def mma_eligible(layout, dtype: str | None = None) -> str | None:
    """Why the "mma" kernel cannot serve ``layout`` with ``dtype`` activations, or None if it can.
    It needs int4 codes in whole-word regular groups of a multiple of 64 (the 8-row interleave) and
    no act-order permutation. ``dtype`` (the table's question): fp16 / bf16 x; a forced "mma"
    configuration (``fit`` asks without a dtype) also runs fp32 x, multiplying in fp32."""
    if layout.bits != 4:
        return f"bits={layout.bits} (int4 only: the 16-bit magic-number dequantization holds 4-bit codes)"
    if layout.per_elem_group or layout.interleave != 8:
        return f"group_size={layout.group_size} (needs whole-word regular groups, a multiple of 64)"
    if layout.has_perm:
        return "an act-order permutation (x would be gathered, not loaded in whole tiles)"
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        return f"dtype={dtype} (the table keeps fp32 activations on kind 'dot')"
    return None


def _fit_mma(cfg: GemvConfig, layout) -> GemvConfig:
    """``fit`` for kind "mma": one group per K tile (the largest power of two dividing the words per
    group, at most MMA_MAX_BKW), 16 to 128 columns; ``x_runs`` only with K tiles of >= 16 word rows
    (its MMAs have K = block_kw; groups of 64 have 8)."""
    wpg = layout.group_size // layout.codes_per_word
    bkw = max(8, min(next_pow2(cfg.block_kw), MMA_MAX_BKW, wpg & -wpg))
    bn = min(max(16, next_pow2(cfg.block_n)), 128)
    return replace(cfg, block_kw=bkw, block_n=bn, group_rows=False, swap_ab=False, dq=2, prefetch=1,
                   x_runs=cfg.x_runs and bkw >= 16)   # x_runs: one MMA of K = block_kw per code position


def choose(layout, M: int, N: int, arch: str, num_sms: int | None = None, group_rows: bool = True,
           dtype: str = "bfloat16", stream: bool = True, cuda_core: bool = False) -> GemvConfig:
    """The table's configuration for ``layout`` (a ``PreparedGemvWeight``), M rows of x in ``dtype``,
    on ``arch``. ``group_rows=False``: the table as it is without group-resident tiles; ``stream=False``:
    without the stream-K kernel (comparisons); ``cuda_core``: the CUDA-core kernel's entry (kind "fma") at
    every M -- the kernel that reads x through a ``QuantGemv.prologue``."""
    num_sms = num_sms or DEFAULT_SMS.get(arch, 132)
    kind = "fma" if (cuda_core or M <= FMA_MAX_M.get(arch, 2) or layout.per_elem_group) else "dot"
    if not cuda_core:
        if arch != "interp" and M >= FRAG_MIN_M and frag_usable(layout, M, dtype) is None:
            kind = "frag"
        elif stream and arch in STREAM_ARCHS and N >= STREAM_MIN_N and stream_usable(layout, M, dtype) is None:
            return fit(GemvConfig("stream", block_n=256, block_kw=16, num_warps=8, prefetch=1, per_sm=2,
                                  pdl=arch in PDL_ARCHS), layout, M)
        elif kind == "dot" and mma_eligible(layout, dtype) is None:
            kind = "mma"
    rows_ok = group_rows and not layout.per_elem_group and not layout.has_perm
    cfg = fit(_table(arch, kind, M, N, layout.K, layout.bits, rows_ok), layout, M)
    if kind == "frag":
        return replace(cfg, split_k=frag_split(N, layout.K, cfg, M, num_sms))
    return replace(cfg, split_k=split_k_for(N, layout.KWP, cfg, num_sms))


def autotune_enabled() -> bool:
    return os.environ.get("PORTAKERN_TRITON_AUTOTUNE", "") not in ("", "0")


def bucket(layout, M: int, N: int, dtype: str) -> str:
    """Tuning bucket: bits, group, zeros, permutation, dtype, M (exact up to 16), N and K rounded to
    powers of two, irregular act-order groups (``kg``: a per-code group table, ``kgroup``) and a fragment
    layout (``fr``). The last two decide which kinds ``fit`` accepts ("mma", "stream" and "frag" need
    regular groups; "frag" a fragment layout), so weights that differ in them must not share a cached
    configuration: a winner restored on a weight that rules it out would be a ``ValueError``."""
    return (f"b{layout.bits}-g{layout.group_size}-z{int(layout.has_z)}-p{int(layout.has_perm)}"
            f"-{dtype}-m{M if M <= 16 else next_pow2(M)}-n{next_pow2(N)}-k{next_pow2(layout.K)}"
            f"-kg{int(getattr(layout, 'kgroup', None) is not None)}-fr{int(getattr(layout, 'frag', None) is not None)}")


def candidates(layout, M: int, N: int, arch: str, num_sms: int, dtype: str = "bfloat16") -> list[GemvConfig]:
    """Configurations worth timing (the table's choice first)."""
    base = choose(layout, M, N, arch, num_sms, dtype=dtype)
    out = [base]
    if base.kind == "stream" or (arch in STREAM_ARCHS and stream_usable(layout, M, dtype) is None):
        # the stream-K kernel next to the CUDA-core tiles: columns, units ahead, programs per SM
        for bn, ahead, per_sm in itertools.product((256, 128), (1, 2), (1, 2, 4)):
            cand = fit(GemvConfig("stream", block_n=bn, block_kw=16, prefetch=ahead, per_sm=per_sm,
                                  pdl=arch in PDL_ARCHS), layout, M)
            if cand not in out:
                out.append(cand)
        if base.kind == "stream":   # and the table's choice without it, whose neighbours follow
            base = choose(layout, M, N, arch, num_sms, dtype=dtype, stream=False)
            out.append(base)
    if base.kind == "frag":  # rows per program (warps x units) and the split around the table's
        for bn, w in ((64, 2), (64, 4), (128, 4), (128, 2), (256, 4), (128, 8)):
            c = fit(replace(base, block_n=bn, num_warps=w), layout, M)
            auto = frag_split(N, layout.K, c, M, num_sms)
            for split in sorted({auto, max(1, auto // 2), min(FRAG_MAX_SPLIT, 2 * auto)}):
                cand = replace(c, split_k=split)
                if cand not in out:
                    out.append(cand)
        return out
    if base.kind == "mma":   # the K tile is the group's; columns, warps, pipeline depth and x path vary
        for bn, w, st, xr in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (False, True)):
            c = fit(replace(base, block_n=bn, num_warps=w, num_stages=st, x_runs=xr), layout, M)
            auto = split_k_for(N, layout.KWP, c, num_sms)
            for split in sorted({auto, max(1, auto // 2), 2 * auto}):
                cand = replace(c, split_k=split)
                if cand not in out:
                    out.append(cand)
        return out
    grid = [(bn, bkw, w, False) for bn in (32, 64, 128) for bkw in (16, 32, 64) for w in (4, 8)]
    if base.kind == "fma" and M == 1 and not layout.per_elem_group and not layout.has_perm:
        # group-resident tiles (4 columns per thread; 8 with one warp of 256): H200 session-4 sweep winners
        grid += [(bn, bkw, w, True) for bn, w in ((128, 1), (256, 1), (256, 2), (512, 4)) for bkw in (8, 16)]
    for bn, bkw, w, rows in grid:
        c = fit(replace(base, block_n=bn, block_kw=bkw, num_warps=w, group_rows=rows), layout, M)
        auto = split_k_for(N, layout.KWP, c, num_sms)
        for split in sorted({auto, max(1, auto // 2)} if rows else {auto, 1}):
            cand = replace(c, split_k=split)
            if cand not in out:
                out.append(cand)
    return out


def tuned(layout, M: int, N: int, dtype: str, device, arch: str, num_sms: int, timer) -> GemvConfig:
    """The cached best configuration of the bucket, timing ``candidates`` with ``timer(cfg) -> s``."""
    from .autotune import cached_best

    return cached_best("triton-gemv", device, bucket(layout, M, N, dtype),
                       candidates(layout, M, N, arch, num_sms, dtype), timer,
                       default=lambda: choose(layout, M, N, arch, num_sms, dtype=dtype),
                       restore=lambda d: fit(GemvConfig(**d), layout, M))
