"""One launch configuration of the quantized GEMV kernels (``GemvConfig``), the rules that make it legal for a
prepared weight (``fit``), and the table's choice (``choose``) from ``tuning.py``'s GEMV tables.

``choose(layout, M, N, arch, num_sms)`` picks the kernel kind for the weight and M, takes the first matching row of
``tuning.GEMV_TILES`` for the family (``common/arch.py``), fits it to the weight and splits K (``split_k_for``,
``frag_split``) until the grid fills the multiprocessors as ``tuning.PROGRAMS_PER_SM`` says.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from portakern.errors import UnsupportedError

from .. import tuning
from ..common.arch import PDL_ARCHS, default_sms

#: Dequantization variants the kernels implement (``GemvConfig.dq``, ``kernels.gemv_common._codes``).
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
               28672x8192 48.1 against 40.9 us, commit 6dd12eb; in no table)
    split_k    slices of K (1: each program covers all of K)
    dq         dequantization variant of ``kernels.gemv_common._codes`` (``DQ_VARIANTS``); 3 (subnormal
               codes, the GPU tables' choice for the CUDA-core kernel; the tensor-core kernel and
               per-element groups run it as 2)
    swap_ab    (tensor-core kernel) dequantized weights as the MMA's A operand, x as B
    prefetch   (CUDA-core kernels: "fma" with num_stages 1, "stream") tiles of words loaded ahead into
               registers: 1 or 2 ("fma": 2 slower on every swept shape, ``gemv-pdl-sweep-h200.json``;
               "stream": 1 and 2 within 2%, ``gemv-stream-probe-h200.json``)
    pdl        programmatic dependent launch (sm_90+, compiled kernels only): the kernel may start
               while the previous kernel in the stream drains; it requests its first weight tiles,
               then waits for that kernel (``griddepcontrol.wait``) before touching x or the output.
               The GPU tables' choice for the CUDA-core, stream and "frag" kernels ("frag": its first
               chunk's words, scales and zeros before the wait; ``tuning.GEMV_TILES``)
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
               table: the H200's decode step at ctx 2048 ran 2.396 / 2.408 ms with 2 and 4 units against
               2.309 without (same process and weights, bit-equal logits; commit 279357b)
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


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def block_m(kind: str, M: int) -> int:
    """Rows of x per program: all of M up to 4 (CUDA cores), 8 or 16 columns of the "frag" kernel's
    MMA result, a 16-row MMA tile (other tensor-core kernels)."""
    if kind == "frag":
        return 8 if M <= 8 else 16
    return min(next_pow2(M), 4) if kind == "fma" else 16


def _in(value: int, bounds) -> bool:
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def table_config(arch: str, kind: str, M: int, N: int, K: int, bits: int, rows_ok: bool = False) -> GemvConfig:
    """The ``tuning.GEMV_TILES`` row for ``kind`` on family ``arch`` at M rows of x and an (N, K) weight of
    ``bits``, as a configuration (before ``fit``). ``rows_ok``: the layout has whole-word regular groups and no
    act-order permutation (what the group-resident sweeps measured)."""
    for row in tuning.GEMV_TILES:
        family = row.get("family", "any")
        if row["kind"] not in (kind, "any") or (family != arch and (family != "any" or arch == "interp")):
            continue
        if row.get("bits") not in (None, bits) or (row.get("rows") and not rows_ok):
            continue
        if not (_in(M, row.get("m", (None, None))) and _in(N, row.get("n", (None, None)))
                and _in(N * K, row.get("nk", (None, None)))):
            continue
        block_n, block_kw, num_warps, num_stages = row["tile"]
        return GemvConfig(kind, block_n=block_n, block_kw=block_kw, num_warps=num_warps, num_stages=num_stages,
                          dq=row.get("dq", 2), swap_ab=row.get("swap_ab", False), x_runs=row.get("x_runs", False),
                          group_rows=row.get("group_rows", False),
                          pdl=row.get("pdl") == "family" and arch in PDL_ARCHS)
    raise LookupError(f"no row of tuning.GEMV_TILES matches kind {kind!r} on {arch} (M={M}, N={N}, K={K}, "
                      f"bits={bits})")


def split_k_for(N: int, KWP: int, cfg: GemvConfig, num_sms: int) -> int:
    """Slices of K so that ``cdiv(N, block_n) * split_k`` reaches ``tuning.PROGRAMS_PER_SM[kind]`` per SM (a
    CUDA-core program of 8 warps counts as two: ``tuning.FMA_PROGRAM_WARPS``; group-resident tiles count warps:
    ``tuning.WARPS_PER_SM_ROWS``), keeping at least two K tiles per slice."""
    tiles_n = math.ceil(N / cfg.block_n)
    iters = math.ceil(KWP / cfg.block_kw)
    if cfg.kind == "frag":   # block_kw 32 words = one 128-column chunk; M is not known here: see frag_split
        raise ValueError("split_k_for(kind='frag'): use frag_split(N, K, cfg, M, num_sms)")
    if cfg.group_rows:   # count warps (these programs are small); slices of at least tuning.ROWS_MIN_SLICE_WORDS
        per_split, want, most = tiles_n * cfg.num_warps, tuning.WARPS_PER_SM_ROWS * num_sms, tuning.MAX_SPLIT_K_ROWS
        room = KWP // tuning.ROWS_MIN_SLICE_WORDS
    else:
        weight = max(1, cfg.num_warps // tuning.FMA_PROGRAM_WARPS) if cfg.kind == "fma" else 1
        per_split, want, most = tiles_n * weight, tuning.PROGRAMS_PER_SM[cfg.kind] * num_sms, tuning.MAX_SPLIT_K
        room = iters // 2
    split = 1
    while per_split * split < want and split * 2 <= most and room >= split * 2:
        split *= 2
    return split


def frag_split(N: int, K: int, cfg: GemvConfig, M: int, num_sms: int) -> int:
    """Slices of K for kind "frag": a power of two up to ``tuning.FRAG_MAX_SPLIT`` while the grid stays within
    ``tuning.FRAG_PROGRAMS_PER_SM`` programs per SM and every slice keeps ``tuning.FRAG_MIN_CHUNKS`` chunks."""
    bm = block_m("frag", M)
    tiles_n = math.ceil(N / cfg.block_n)
    chunks = math.ceil(K / 128)
    want = tuning.FRAG_PROGRAMS_PER_SM[bm] * num_sms
    split = 1
    while (split * 2 <= tuning.FRAG_MAX_SPLIT and tiles_n * split * 2 <= want
           and chunks >= tuning.FRAG_MIN_CHUNKS[bm] * split * 2):
        split *= 2
    return split


def split_merge(kind: str, N: int, K: int) -> int:
    """The ``MERGE`` constexpr of a "frag" or "fma" kernel for an (N, K) weight: the kind's switch
    (``tuning.SPLIT_MERGE``) up to ``tuning.SPLIT_MERGE_MAX_NK`` elements, 0 (the last slice to arrive merges)
    above, where a grid of several waves leaves every merging slice to the last one (measured for "frag"; no
    "fma" row that large splits K in the sm_90 table, and none was timed)."""
    return tuning.SPLIT_MERGE[kind] if N * K <= tuning.SPLIT_MERGE_MAX_NK else 0


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
    kernel's own rules: ``stream.usable``)."""
    from .stream import usable

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
    if cfg.kind not in tuning.PROGRAMS_PER_SM:
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}): the kinds are {', '.join(tuning.PROGRAMS_PER_SM)}")
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


def mma_eligible(layout, dtype: str | None = None) -> str | None:
    """Why the "mma" kernel cannot serve ``layout`` with ``dtype`` activations, or None if it can.
    It needs int4 codes in whole-word regular groups of a multiple of 64 (the 8-row interleave) and
    no act-order permutation. ``dtype`` (the table's question): fp16 / bf16 x; a forced "mma"
    configuration (``fit`` asks without a dtype) also runs fp32 x, multiplying in fp32."""
    if layout.bits != 4:
        return f"bits={layout.bits} (int4 only: the 16-bit magic-number dequantization holds 4-bit codes)"
    if getattr(layout, "has_mins", False):
        return "a float minimum per group (GGUF Q4_K; the 'fma' and 'dot' kernels subtract it)"
    if layout.per_elem_group or layout.interleave != 8:
        return f"group_size={layout.group_size} (needs whole-word regular groups, a multiple of 64)"
    if layout.has_perm:
        return "an act-order permutation (x would be gathered, not loaded in whole tiles)"
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        return f"dtype={dtype} (the table keeps fp32 activations on kind 'dot')"
    return None


def _fit_mma(cfg: GemvConfig, layout) -> GemvConfig:
    """``fit`` for kind "mma": one group per K tile (the largest power of two dividing the words per
    group, at most ``tuning.MMA_MAX_BKW``), 16 to 128 columns; ``x_runs`` only with K tiles of >= 16 word rows
    (its MMAs have K = block_kw; groups of 64 have 8)."""
    wpg = layout.group_size // layout.codes_per_word
    bkw = max(8, min(next_pow2(cfg.block_kw), tuning.MMA_MAX_BKW, wpg & -wpg))
    bn = min(max(16, next_pow2(cfg.block_n)), 128)
    return replace(cfg, block_kw=bkw, block_n=bn, group_rows=False, swap_ab=False, dq=2, prefetch=1,
                   x_runs=cfg.x_runs and bkw >= 16)   # x_runs: one MMA of K = block_kw per code position


def choose(layout, M: int, N: int, arch: str, num_sms: int | None = None, group_rows: bool = True,
           dtype: str = "bfloat16", stream: bool = True, cuda_core: bool = False) -> GemvConfig:
    """The table's configuration for ``layout`` (a ``PreparedGemvWeight``), M rows of x in ``dtype``,
    on ``arch``. ``group_rows=False``: the table as it is without group-resident tiles; ``stream=False``:
    without the stream-K kernel (comparisons); ``cuda_core``: the CUDA-core kernel's entry (kind "fma") at
    every M -- the kernel that reads x through a ``QuantGemv.prologue``. A weight without words (``layout=
    "fragments"``: ``has_words`` False) runs the "frag" kernel at every M (``tuning.FRAG_MIN_M`` is for weights that
    hold both layouts), and raises ``UnsupportedError`` where that kernel cannot run the call."""
    num_sms = num_sms or (tuning.GEMV_INTERP_SMS if arch == "interp" else default_sms(arch))
    if not getattr(layout, "has_words", True):   # fragments only (layout="fragments"): the "frag" kernel at every M
        why = "a prologue reads x on the CUDA-core kernel" if cuda_core else frag_usable(layout, M, dtype)
        if why is not None or arch == "interp":
            raise UnsupportedError(f"the prepared weight holds its codes only in the fragment layout "
                                   f"(layout='fragments'), which the 'frag' kernel alone reads, and it cannot run "
                                   f"here: {why or 'Triton interpreter (Gluon kernel)'}; prepare the weight with "
                                   f"layout='words+fragments' for this call")
        cfg = fit(table_config(arch, "frag", M, N, layout.K, layout.bits, False), layout, M)
        return replace(cfg, split_k=frag_split(N, layout.K, cfg, M, num_sms))
    kind = "fma" if (cuda_core or M <= tuning.FMA_MAX_M.get(arch, 2) or layout.per_elem_group) else "dot"
    if not cuda_core:
        if arch != "interp" and M >= tuning.FRAG_MIN_M and frag_usable(layout, M, dtype) is None:
            kind = "frag"
        elif (stream and arch in tuning.STREAM and N >= tuning.STREAM_MIN_N
              and stream_usable(layout, M, dtype) is None):
            return fit(GemvConfig("stream", block_n=256, block_kw=16, num_warps=8, prefetch=1, per_sm=2,
                                  pdl=arch in PDL_ARCHS), layout, M)
        elif kind == "dot" and mma_eligible(layout, dtype) is None:
            kind = "mma"
    rows_ok = group_rows and not layout.per_elem_group and not layout.has_perm
    cfg = fit(table_config(arch, kind, M, N, layout.K, layout.bits, rows_ok), layout, M)
    if kind == "frag":
        return replace(cfg, split_k=frag_split(N, layout.K, cfg, M, num_sms))
    return replace(cfg, split_k=split_k_for(N, layout.KWP, cfg, num_sms))
