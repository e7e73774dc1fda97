"""Launch configurations for the quantized GEMV kernels: a per-arch table, and optional autotuning.

``choose(layout, M, N, dtype, arch, num_sms)`` returns a ``GemvConfig``. The table is keyed by the
architecture family:

==========  ===========================================================================
arch        source of the numbers
==========  ===========================================================================
sm_90       H200 sweeps (sessions 1-3) in ``benchmarks/gemv_notes.md`` (``benchmarks/gemv.py --sweep``)
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
#: tiles: M=16 155 us vs 169 us with 4 slices), so it splits only to fill each SM once.
PROGRAMS_PER_SM = {"fma": 4, "dot": 1}
MAX_SPLIT_K = 8


#: Dequantization variants the kernels implement (``GemvConfig.dq``, ``kernels.gemv_quant._codes``).
DQ_VARIANTS = (0, 1, 2, 3)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration.

    kind       "fma" (CUDA cores, small M) or "dot" (tensor cores, M tile of 16)
    block_n    rows of W per program
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
    prefetch   (CUDA-core kernel, num_stages 1) tiles of words loaded ahead into registers: 1 or 2
               (2: more bytes in flight per SM for 8 more registers; H200 session 3: slower on every
               swept shape, in no table)
    pdl        programmatic dependent launch (sm_90+, compiled kernels only): the kernel may start
               while the previous kernel in the stream drains; it requests its first weight tiles,
               then waits for that kernel (``griddepcontrol.wait``) before touching x or the output.
               The GPU tables' choice for the CUDA-core kernel
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
    """Rows of x per program: all of M up to 4 (CUDA cores), a 16-row MMA tile (tensor cores)."""
    return min(next_pow2(M), 4) if kind == "fma" else 16


def _table(arch: str, kind: str, M: int, N: int, K: int, bits: int) -> GemvConfig:
    """The hand table: a (block_kw, block_n) word tile gives each thread 4 16-byte loads."""
    if arch == "interp":
        return (GemvConfig("fma", block_n=8, block_kw=8, num_warps=1) if kind == "fma"
                else GemvConfig("dot", block_n=16, block_kw=16, num_warps=1))
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
    """Slices of K so that ``cdiv(N, block_n) * split_k`` reaches PROGRAMS_PER_SM[kind] per SM,
    keeping at least two K tiles per slice."""
    tiles_n = math.ceil(N / cfg.block_n)
    iters = math.ceil(KWP / cfg.block_kw)
    split = 1
    while (tiles_n * split < PROGRAMS_PER_SM[cfg.kind] * num_sms and split * 2 <= MAX_SPLIT_K
           and iters >= split * 2 * 2):
        split *= 2
    return split


def fit(cfg: GemvConfig, layout, M: int) -> GemvConfig:
    """Make ``cfg`` legal: power-of-two tiles, K tile within the padded rows (a multiple of 64).
    An unknown ``dq`` is an error (it would silently run another variant)."""
    if cfg.dq not in DQ_VARIANTS:
        raise ValueError(f"GemvConfig(dq={cfg.dq!r}): the gemv kernels implement dq in {DQ_VARIANTS}")
    if cfg.prefetch not in (1, 2) or (cfg.prefetch == 2 and cfg.kind != "fma"):
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, prefetch={cfg.prefetch!r}): prefetch is 1, or 2 for the "
                         f"CUDA-core kernel (kind='fma'); use prefetch=1")
    if cfg.swap_ab and cfg.kind != "dot":
        raise ValueError(f"GemvConfig(kind={cfg.kind!r}, swap_ab=True): swap_ab is an option of the tensor-core "
                         f"kernel; use kind='dot' or swap_ab=False")
    bkw = min(next_pow2(cfg.block_kw), 64)
    bn = next_pow2(cfg.block_n)
    if cfg.kind == "dot":  # MMA needs 16 along K and N
        bkw, bn = max(16, bkw), max(16, bn)
    return replace(cfg, block_kw=bkw, block_n=bn)


def choose(layout, M: int, N: int, arch: str, num_sms: int | None = None) -> GemvConfig:
    """The table's configuration for ``layout`` (a ``PreparedGemvWeight``), M rows of x, on ``arch``."""
    num_sms = num_sms or DEFAULT_SMS.get(arch, 132)
    kind = "fma" if (M <= FMA_MAX_M.get(arch, 2) or layout.per_elem_group) else "dot"
    cfg = fit(_table(arch, kind, M, N, layout.K, layout.bits), layout, M)
    return replace(cfg, split_k=split_k_for(N, layout.KWP, cfg, num_sms))


def autotune_enabled() -> bool:
    return os.environ.get("PORTAKERN_TRITON_AUTOTUNE", "") not in ("", "0")


def bucket(layout, M: int, N: int, dtype: str) -> str:
    """Tuning bucket: bits, group, M (exact up to 16), N and K rounded to powers of two."""
    return (f"b{layout.bits}-g{layout.group_size}-z{int(layout.has_z)}-p{int(layout.has_perm)}"
            f"-{dtype}-m{M if M <= 16 else next_pow2(M)}-n{next_pow2(N)}-k{next_pow2(layout.K)}")


def candidates(layout, M: int, N: int, arch: str, num_sms: int) -> list[GemvConfig]:
    """Configurations worth timing (the table's choice first)."""
    base = choose(layout, M, N, arch, num_sms)
    out = [base]
    if base.kind == "fma":
        grid = [(bn, bkw, w) for bn in (32, 64, 128) for bkw in (16, 32, 64) for w in (4, 8)]
    else:
        grid = [(bn, bkw, w) for bn in (32, 64, 128) for bkw in (16, 32, 64) for w in (4, 8)]
    for bn, bkw, w in grid:
        c = fit(replace(base, block_n=bn, block_kw=bkw, num_warps=w), layout, M)
        for split in sorted({split_k_for(N, layout.KWP, c, num_sms), 1}):
            cand = replace(c, split_k=split)
            if cand not in out:
                out.append(cand)
    return out


def tuned(layout, M: int, N: int, dtype: str, device, arch: str, num_sms: int, timer) -> GemvConfig:
    """The cached best configuration of the bucket, timing ``candidates`` with ``timer(cfg) -> s``."""
    from .autotune import cached_best

    return cached_best("triton-gemv", device, bucket(layout, M, N, dtype), candidates(layout, M, N, arch, num_sms), timer,
                       default=lambda: choose(layout, M, N, arch, num_sms), restore=lambda d: fit(GemvConfig(**d), layout, M))
