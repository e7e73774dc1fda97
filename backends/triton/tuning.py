"""Launch configurations for the Triton attention kernels: per-arch tables, and optional autotuning.

``choose(op, arch, num_sms)`` picks tile sizes, warps, pipeline depth, GQA packing and the number
of KV splits from the table of the device's architecture family:

==========  ===========================================================================
arch        source of the numbers
==========  ===========================================================================
sm_90       H200 sweeps, see ``benchmarks/attention_notes.md`` (``benchmarks/attention.py --sweep``)
sm_80       the sm_90 shapes cut to sm_80's 163 KiB of shared memory (not measured here)
sm_120      consumer parts (99 KiB of shared memory): smaller tiles (not measured here)
interp      Triton's CPU interpreter: small tiles so tests cross tile and split boundaries
==========  ===========================================================================

With ``PORTAKERN_TRITON_AUTOTUNE=1`` the first call of a problem bucket times the candidates of
``candidates()`` on the device and keeps the fastest in ``portakern.cache.TuningCache`` (keyed by
device identity, portakern and Triton versions, and the bucket); a later process reads it back.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

#: Shared memory a block may use, bytes (the opt-in maximum per architecture).
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
              "sm_100": 227 * 1024, "sm_120": 99 * 1024, "interp": 1 << 30}
#: Multiprocessors assumed when lowering for a target without the device.
DEFAULT_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_100": 148, "sm_120": 84, "interp": 8}

#: Split-KV bounds: at most MAX_SPLITS splits, each at least MIN_TILES_PER_SPLIT key tiles.
MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 2
#: Who merges the splits, per architecture family: True = the last split to finish (one launch,
#: ``_merge_splits``), False = the separate ``attn_combine`` kernel. H200 sweep (session 2, CUDA-graph
#: timing, B=1 decode 8k / 32k / 128k): the separate kernel won at every split count, 15.7 vs 18.5 us
#: at 8k (16 splits): the fused merge runs on one program per query tile after the others finish,
#: leaving the SMs idle. The interpreter keeps the fused merge so tests cover it.
FUSED_COMBINE = {"interp": True}
#: Split until the grid holds this many programs per multiprocessor. H200 sweep (session 2): dense
#: 16 splits (1 per SM) beat 24-64 by 4-15%; paged with BN=128 tiles likewise (16 splits 47.4 us vs
#: 32 splits 53.8 at 32k, page 16).
PROGRAMS_PER_SM = 1


@dataclass(frozen=True)
class AttnConfig:
    """One launch configuration of ``attn_fwd`` (and ``attn_combine`` when ``num_splits > 1``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: int = 1          # query heads per tile row group: 1 or the GQA group size
    num_splits: int = 1    # KV splits (1 = no workspace, no combine)
    fused_combine: bool = True  # the last split merges (one launch) instead of attn_combine
    #: programmatic dependent launch (sm_90+): ``attn_fwd`` is launched while the previous kernel in
    #: the stream drains and waits for it (``griddepcontrol.wait``) before its first read; with a
    #: separate merge, ``attn_combine`` is launched the same way behind ``attn_fwd``. Session 3 (H200):
    #: the merge alone as a dependent gained < 0.1 us (benchmarks/attention_notes.md, v3)
    pdl: bool = False
    #: rescale the accumulator only when a row maximum grows by > 2^8 (FA4's conditional rescale).
    #: In no table yet: unmeasured (see benchmarks/attention_notes.md)
    lazy_rescale: bool = False
    #: dense prefill (pack 1): load K and V tiles through host-built TMA tensor descriptors instead of
    #: pointer tiles (sm_90+; the interpreter runs them too). A call whose K or V breaks TMA's rules
    #: (base 16-byte aligned, every stride but the last a multiple of 16 bytes, last stride 1) runs
    #: the pointer kernel instead, compiled on first need (see ``attention.build``). ``fit`` clears it
    #: for ops it cannot serve (paged, varlen, packed decode). In no table yet: unmeasured (v4)
    tma: bool = False
    #: run the Gluon prefill kernel for sm_90 (``kernels/attention_wgmma.py``: a TMA load warp and two
    #: 64-row consumer warpgroups with their own schedule) with ``block_n`` keys per tile and a ring of
    #: ``num_stages >= 2`` K/V buffers; ``block_m`` 128 and ``num_warps`` 4 (12 at launch) are fixed.
    #: ``attention_wgmma.blocker`` says which ops it serves (``check_wgmma``, ``fit``)
    wgmma: bool = False
    #: the Gluon kernel's K ring depth where it differs from the V ring's ``num_stages`` (0: the same).
    #: A K stage is free once the tile's scores are done, a tile before its V stage, so a deeper K ring
    #: lets the loads run further ahead where shared memory has room for one more K tile but not a
    #: K/V pair (D=256: 3 K + 2 V buffers of 64 keys beside the 64 KiB query tile)
    k_stages: int = 0
    #: run split decode on the Gluon kernel for sm_90 (``kernels/attention_decode_ws.py``: a load warp that
    #: reads the block table and fills a ring of ``num_stages`` K/V stages of ``block_n`` keys by TMA, one
    #: consumer warpgroup) with ``num_splits`` splits merged by ``attn_combine`` (``fused_combine`` is
    #: ignored; ``pdl`` launches the kernel as a dependent of the previous one and the merge as its
    #: dependent). ``attention_decode_ws.blocker`` says which ops it
    #: serves (``check_decode_ws``, ``fit``)
    decode_ws: bool = False
    #: (sm_90+) the merge (``attn_combine``) lets the next kernel in the stream launch as soon as it starts
    #: (``griddepcontrol.launch_dependents``), so a next kernel launched as a programmatic dependent -- the
    #: GEMV of the output projection in a decode step -- sets up and requests its first weight tiles while the
    #: merge runs; that kernel still waits for the merge's completion before it reads the output. ``attn_fwd``
    #: and the Gluon decode kernel with ``pdl`` already do so at their start; without a separate merge
    #: (``num_splits`` 1, or ``fused_combine`` on ``attn_fwd``) it changes nothing
    release_next: bool = False
    #: (sm_90+, the Gluon decode kernel with ``num_splits > 1``) the decode kernel lets its merge launch as soon
    #: as it starts, the merge is launched as a programmatic dependent of it (it waits for the partials before
    #: reading them) and, with ``release_next``, lets the next kernel launch *before* that wait: a next kernel
    #: launched as a programmatic dependent (the o-projection GEMV of a decode step) becomes resident and
    #: requests its first weight tiles while the decode kernel itself runs, and still waits for the merge's
    #: completion (hence the decode kernel's) before reading the output
    early_merge: bool = False

    def to_json(self) -> dict:
        return asdict(self)


#: Architecture families with grid dependency control (``griddepcontrol``, needed by ``pdl``).
PDL_ARCHS = ("sm_90", "sm_100", "sm_120")


def check_pdl(cfg, arch: str) -> None:
    """Raise when ``cfg`` (an ``AttnConfig`` or ``gemv_tuning.GemvConfig``) asks for programmatic
    dependent launch where it cannot run."""
    if cfg.pdl and arch not in PDL_ARCHS:
        raise ValueError(f"{type(cfg).__name__}(pdl=True) on {arch}: programmatic dependent launch needs one of "
                         f"{', '.join(PDL_ARCHS)} (and a compiled kernel, not the interpreter); use pdl=False")
    if getattr(cfg, "release_next", False) and arch not in PDL_ARCHS:
        raise ValueError(f"{type(cfg).__name__}(release_next=True) on {arch}: letting the next kernel launch early "
                         f"needs grid dependency control, on {', '.join(PDL_ARCHS)} (and a compiled kernel, not the "
                         f"interpreter); use release_next=False")
    if getattr(cfg, "early_merge", False):
        if arch not in PDL_ARCHS:
            raise ValueError(f"AttnConfig(early_merge=True) on {arch}: launching the merge while the decode kernel "
                             f"runs needs grid dependency control, on {', '.join(PDL_ARCHS)} (and a compiled "
                             f"kernel, not the interpreter); use early_merge=False")
        if not cfg.decode_ws or cfg.num_splits < 2:
            raise ValueError(f"AttnConfig(early_merge=True, decode_ws={cfg.decode_ws}, num_splits={cfg.num_splits}): "
                             f"early_merge is an option of the Gluon decode kernel with a separate merge "
                             f"(decode_ws=True, num_splits >= 2); use early_merge=False")


#: Architecture families with the tensor-memory accelerator (TMA descriptors, ``tma``).
TMA_ARCHS = ("sm_90", "sm_100", "sm_120")


def tma_applies(op, cfg: AttnConfig) -> bool:
    """Whether ``op`` under ``cfg`` is a tile walk the TMA path serves: dense keys, one head per tile,
    more than one key. With ``seqlen_k == 1`` Triton specialises the argument to the constant 1 and
    the TMA kernel then crashes Triton 3.6's ptxas (exit -11, sm_90a; reproduced off the GPU by
    compiling with that specialisation); one key gains nothing from TMA anyway."""
    return op.kv_layout.value == "dense" and cfg.pack == 1 and op.seqlen_k > 1


def check_tma(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for TMA loads where they cannot run."""
    if not cfg.tma:
        return
    if arch != "interp" and arch not in TMA_ARCHS:
        raise ValueError(f"AttnConfig(tma=True) on {arch}: tensor-descriptor (TMA) loads need one of "
                         f"{', '.join(TMA_ARCHS)}; use tma=False")
    if not tma_applies(op, cfg):
        raise ValueError(f"AttnConfig(tma=True) for {op.kv_layout.value} attention with pack={cfg.pack} "
                         f"and seqlen_k={op.seqlen_k}: the TMA path serves dense keys with one head per tile "
                         f"(prefill) and more than one key; use tma=False "
                         f"or pass the config through tuning.fit")


def check_wgmma(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for the Gluon prefill kernel where it cannot run or in a shape it has not."""
    if not cfg.wgmma:
        if cfg.k_stages:
            raise ValueError(f"AttnConfig(k_stages={cfg.k_stages}) without wgmma: a separate K ring depth is the "
                             f"Gluon prefill kernel's; use k_stages=0 or wgmma=True")
        return
    from .attention_wgmma import blocker

    why = blocker(op, arch)
    if why is not None:
        why = f"does not serve this op ({why})"
    elif (cfg.block_m, cfg.num_warps) != (128, 4):
        why = f"runs block_m=128 with num_warps=4, not {cfg.block_m} / {cfg.num_warps}"
    if why is None and (cfg.num_stages < 2 or cfg.block_n not in (32, 64, 128)):
        why = f"needs num_stages >= 2 and block_n 32, 64 or 128, not {cfg.num_stages} / {cfg.block_n}"
    if why is None and cfg.k_stages and cfg.k_stages < 2:
        why = f"needs k_stages 0 (num_stages) or >= 2, not {cfg.k_stages}"
    need = smem_bytes(op, 128, cfg.block_n, cfg.num_stages, cfg.k_stages) + WGMMA_SMEM_EXTRA
    if why is None and need > SMEM_LIMIT[arch]:
        why = (f"with block_n={cfg.block_n}, num_stages={cfg.num_stages} and k_stages={cfg.k_stages} needs "
               f"{need} bytes of shared memory, over {arch}'s {SMEM_LIMIT[arch]}")
    if why is None and (cfg.tma or cfg.lazy_rescale or cfg.pack > 1 or cfg.num_splits > 1):
        why = "has its own TMA loads and schedule: tma, lazy_rescale, pack and num_splits stay off"
    if why:
        raise ValueError(f"AttnConfig(wgmma=True): the Gluon prefill kernel {why}; use wgmma=False "
                         f"or pass the config through tuning.fit")


def check_decode_ws(op, cfg: AttnConfig, arch: str) -> None:
    """Raise when ``cfg`` asks for the Gluon decode kernel where it cannot run or in a shape it has not."""
    if not cfg.decode_ws:
        return
    from .attention_decode_ws import blocker, smem_bytes as ws_smem

    why = blocker(op, arch, cfg.block_n)
    if why is not None:
        why = f"does not serve this op ({why})"
    elif cfg.num_stages < 2:
        why = f"needs num_stages >= 2, not {cfg.num_stages}"
    elif ws_smem(op, cfg.block_n, cfg.num_stages) + WGMMA_SMEM_EXTRA > SMEM_LIMIT[arch]:
        why = (f"with block_n={cfg.block_n} and num_stages={cfg.num_stages} needs "
               f"{ws_smem(op, cfg.block_n, cfg.num_stages) + WGMMA_SMEM_EXTRA} bytes of shared memory, over "
               f"{arch}'s {SMEM_LIMIT[arch]}")
    elif cfg.wgmma or cfg.tma or cfg.lazy_rescale:
        why = "has its own TMA loads and schedule: wgmma, tma and lazy_rescale stay off"
    if why:
        raise ValueError(f"AttnConfig(decode_ws=True): the Gluon decode kernel {why}; use decode_ws=False "
                         f"or pass the config through tuning.fit")


def arch_family(cc: int | None) -> str:
    """Table key for a compute capability (80, 86, 89, 90, 100, 120; None = interpreter)."""
    if cc is None:
        return "interp"
    if cc >= 120:
        return "sm_120"
    if cc >= 100:
        return "sm_100"
    if cc >= 90:
        return "sm_90"
    if cc in (86, 87, 89):
        return f"sm_{cc if cc != 87 else 86}"
    return "sm_80"


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def decode_rows(op) -> int | None:
    """Query rows per sequence when the G query heads of a KV head should share one tile, else None.

    That is decode and short speculative windows: few query rows, so packing ``rows * G`` (row, head)
    pairs into one tile loads each K/V tile once per KV head instead of once per query head.
    """
    if op.group_size == 1:
        return None
    if op.kv_layout.value == "varlen":
        rows = -(-op.total_q // op.batch)        # average query rows per sequence
    else:
        rows = op.seqlen_q
    return rows if rows <= 16 and rows * op.group_size <= 128 else None


def smem_bytes(op, block_m: int, block_n: int, stages: int, k_stages: int = 0) -> int:
    """Estimate of shared memory: pipelined K and V tiles (``k_stages`` K tiles when not 0) plus the q tile."""
    elt = 4 if op.dtype.value == "float32" else 2
    bd, bdv = max(16, next_pow2(op.head_dim)), max(16, next_pow2(op.head_dim_v))
    return ((k_stages or stages) * bd + stages * bdv) * block_n * elt + block_m * bd * elt


def _base_table(op, arch: str) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a prefill tile, before fitting."""
    d = max(op.head_dim, op.head_dim_v)
    fp32 = op.dtype.value == "float32"
    if arch == "interp":
        return 16, 16, 4, 1
    if fp32:
        return 64, 32, 4, 2
    if arch in ("sm_90", "sm_100"):
        # H200 sweep (run 2): BN=64 beat BN=128 by 10-20% at every D; 3-4 stages tie at D <= 128
        return (128, 64, 8, 3) if d <= 128 else (128, 64, 8, 2)
    if arch == "sm_80":
        return (128, 64, 4, 3) if d <= 64 else (128, 64, 8, 2) if d <= 128 else (64, 64, 4, 2)
    return (64, 64, 4, 2) if d <= 128 else (64, 32, 4, 2)


def _decode_table(op, arch: str) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) for a packed decode tile."""
    if arch == "interp":
        return 16, 4, 1
    d = max(op.head_dim, op.head_dim_v)
    if op.dtype.value == "float32":
        return 32, 4, 2
    if arch in ("sm_90", "sm_100"):
        # H200 sweeps (CUDA-graph timing): dense keys BN=64 with 4 stages; on sm_100 paged keys keep
        # session 2's BN=128 with 3 stages. On sm_90 paged keys take the dense tile too (session 13, B=64 4k,
        # `attention-decode-sweep-b64-h200.json`: pages of 16 255.8 us vs 278.6 with 128-key tiles, pages of 64
        # 250.2 vs 260.2, dense 246.3; 64-key tiles with 3 stages, session 2's comparison, 302.1 / 280.7)
        if op.kv_layout.value == "paged" and arch != "sm_90":
            return (128, 4, 3) if d <= 128 else (64, 4, 3)
        return (64, 4, 4) if d <= 128 else (64, 4, 3)
    return (64, 4, 3) if d <= 128 else (32, 4, 2)


def choose(op, arch: str, num_sms: int | None = None, wgmma: bool = True) -> AttnConfig:
    """The table configuration for ``op`` on architecture family ``arch`` (see ``arch_family``);
    ``wgmma=False``: the ``attn_fwd`` configuration even where the table runs a Gluon kernel (the
    prefill kernel, ``wgmma``, or the decode kernel, ``decode_ws``)."""
    num_sms = num_sms or DEFAULT_SMS.get(arch, 132)
    G = op.group_size
    rows = decode_rows(op)
    tiles = _wgmma_in_table(op, arch) if wgmma and rows is None else None
    if tiles:
        return AttnConfig(128, tiles[0], 4, tiles[1], wgmma=True)
    if rows is not None:
        pack = G
        block_m = min(max(16, next_pow2(rows * G)), max(128, next_pow2(G)))
        block_n, warps, stages = _decode_table(op, arch)
    else:
        pack = 1
        block_m, block_n, warps, stages = _base_table(op, arch)
        if op.kv_layout.value != "varlen":
            block_m = min(block_m, max(16, next_pow2(op.seqlen_q)))
        if block_m < 128 and warps == 8:
            warps = 4
    cfg = AttnConfig(block_m, block_n, warps, stages, pack, tma=rows is None and _tma_in_table(op, arch))
    cfg = fit(op, cfg, arch)
    splits = num_splits(op, cfg, num_sms)
    if splits > 1 and rows is not None and op.kv_layout.value == "paged":
        cfg, splits = _split_paged(op, cfg, arch, num_sms, splits, gluon=wgmma)
    if cfg.decode_ws:        # its own merge launch, as measured: separate, not a dependent; it releases the next
        return replace(cfg, num_splits=splits, fused_combine=False, pdl=False,
                       release_next=splits > 1 and arch in RELEASE_NEXT_TABLE,
                       early_merge=splits > 1 and arch in EARLY_MERGE_TABLE)
    fused = FUSED_COMBINE.get(arch, False)
    return replace(cfg, num_splits=splits, fused_combine=fused, pdl=splits > 1 and arch in SPLIT_PDL_TABLE)


def _split_paged(op, cfg: AttnConfig, arch: str, num_sms: int, splits: int,
                 gluon: bool = True) -> tuple[AttnConfig, int]:
    """Kernel, tile and split count of paged decode whose keys are split (``SPLIT_PAGED_WS`` where the
    Gluon decode kernel serves ``op`` and ``gluon``, else ``SPLIT_PAGED_TILE``, else ``SPLIT_PAGED_BN``);
    once the grid is full, the fewest splits with the same longest split."""
    from .attention_decode_ws import blocker as ws_blocker

    ws = SPLIT_PAGED_WS.get(arch) if gluon else None
    tile = SPLIT_PAGED_TILE.get(arch) if op.dtype.value != "float32" else None
    if ws and ws_blocker(op, arch, ws[0]) is None:
        cfg = fit(op, replace(cfg, block_n=ws[0], num_stages=ws[1], num_warps=4, decode_ws=True), arch)
        per_sm = PROGRAMS_PER_SM
    elif tile:
        bn, stages, per_sm = tile
        cfg = fit(op, replace(cfg, block_n=bn, num_stages=stages), arch)
        if per_sm * smem_bytes(op, cfg.block_m, cfg.block_n, cfg.num_stages) > SMEM_LIMIT.get(arch, 0):
            per_sm = PROGRAMS_PER_SM                # their rings would not fit one SM together
    else:
        bn, per_sm = SPLIT_PAGED_BN.get(arch, cfg.block_n), PROGRAMS_PER_SM
        if not (bn < cfg.block_n and op.page_size % bn == 0):
            return cfg, splits
        cfg = fit(op, replace(cfg, block_n=bn), arch)
    splits = num_splits(op, cfg, num_sms, per_sm)
    if splits == per_sm * num_sms // query_tiles(op, cfg):
        # the grid is full: the fewest splits with the same longest split (32, not 33, at 32k keys)
        tiles = -(-op.seqlen_k // cfg.block_n)
        splits = -(-tiles // -(-tiles // splits))
    return cfg, splits


#: ``(block_n, num_stages)`` of split paged decode on the Gluon kernel (``AttnConfig.decode_ws``, one program per
#: SM), per family. H200 session 14 (B=1, 32/8 heads, D=128, CUDA graph, same run as the attn_fwd table,
#: ``results/decode-ws-h200.json``): 64-key tiles, 4 stages, 16 splits: pages of 16 14.83 / 37.83 us
#: at 8k / 32k keys against attn_fwd's 16.72 / 39.88 (dense attn_fwd 13.99 / 36.33: +6.0% / +4.1%), pages of 64
#: 14.75 / 37.58 against 15.18 / 37.93; dense keys tie (14.11 / 36.16), so they stay on attn_fwd; 3 stages 0.1-1.4
#: us slower, 32 splits (two waves) 4-5 us slower. Unsplit (B=64 4k, pages of 16) it lost, 260.8 vs 250.3 us.
SPLIT_PAGED_WS = {"sm_90": (64, 4)}
#: Key tile of paged decode whose query tiles leave SMs idle (so the keys are split), per family without a
#: ``SPLIT_PAGED_TILE`` entry (one program per SM, pages holding whole tiles only). From the H200's session 6
#: (sm_90 until session 13; B=1, 32/8 heads, D=128, page 64, CUDA graph, 16 splits): 2k keys 10.1 us vs 12.2
#: with 128 (9.9 at 12 splits), 8k 16.4 vs 18.5; page 16 with 64-key tiles at one program per SM ran B=1 32k
#: in 55.6 us (a page id per key) vs 47.8 with 128.
SPLIT_PAGED_BN = {"sm_100": 64}
#: ``(block_n, num_stages, programs per SM)`` of split paged decode (16-bit inputs, every page size), per
#: family; the others take ``SPLIT_PAGED_BN`` for pages holding whole tiles. H200 session 13 (B=1, 32/8 heads,
#: D=128, 64-key tiles with 3 stages, 96 KiB: two programs fit an SM; CUDA graph, long graphs of
#: ``benchmarks/attention.py``, `attention-decode-sweep-h200.json`): pages of 16 at 32 splits 16.7 / 40.3 us
#: at 8k / 32k keys against 17.8 / 41.9 for session 12's table (128-key tiles, 16 splits, merged in the last
#: split) and 18.5 / 43.9 for 64-key tiles at 16 splits; pages of 64 at 32 splits 15.3 / 38.6 against 15.2 /
#: 40.2 at 16; 33 splits (2 x 132 / 8) 0.45 us slower than 32 at 32k (`attention-decode-sweep-p16-h200.json`). Dense keys keep one
#: program per SM (36.9 vs 37.3 us at 32k).
SPLIT_PAGED_TILE = {"sm_90": (64, 3, 2)}
#: Families whose table launches split decode (``attn_fwd`` + ``attn_combine``) as programmatic
#: dependents. H200 session 6 sweep (B=1, CUDA graph): pdl won or tied at every shape, by 0.1-0.9 us
#: (dense 4k 11.7 vs 11.8, 8k 15.6 vs 15.7, 32k 43.0 vs 43.1; paged 2k 9.9 vs 10.7 at 12 splits, 8k
#: 16.4 vs 16.7); unsplit it lost (B=64 4k 265.7 vs 258.6 us, session 3) and stays off.
SPLIT_PDL_TABLE = ("sm_90",)
#: Families whose table has the Gluon decode kernel's merge release the next kernel at its start
#: (``AttnConfig.release_next``). H200 session 16, Llama-3-8B-shaped decode step at ctx 2048 (one CUDA graph,
#: same process and weights, logits bit-equal; ``results/decode-step-attention-release-h200.json``): 2.296 ms
#: against 2.314 / 2.320 (table, and the same table through the explicit build path), i.e. the o-projection
#: GEMV starting while the merge runs; the decode kernel also launched as a dependent (``pdl``) 2.285 ms, not
#: adopted (slower in back-to-back attention calls, session 15)
RELEASE_NEXT_TABLE = ("sm_90",)
#: Families whose table launches the Gluon decode kernel's merge at the kernel's start and has the merge release
#: the next kernel before its wait (``AttnConfig.early_merge``). H200 session 17, the same decode step (same
#: process and weights, logits bit-equal; ``results/decode-step-attention-early-merge-h200.json``): 2.269 ms
#: against 2.288 / 2.290 at ctx 2048, 2.527 against 2.542 / 2.547 at 8192 (the o-projection GEMV resident and
#: loading its first tiles while the decode kernel runs); with the decode kernel also a dependent (``pdl``)
#: 2.317 / 2.541, not adopted
EARLY_MERGE_TABLE = ("sm_90",)


#: Architectures whose table loads prefill K/V through TMA for head dims above 128.
#: H200 session 3 (B=4, S=4k, bf16, table tile): D=256 513 vs 463 TFLOP/s (causal 454 vs 433), D=128
#: 458 vs 454 and 400 vs 407 (a tie), D=64 396 vs 423 (slower); outputs bitwise equal to the pointer
#: kernel's. The one gpu-tier failure seen with it (ptxas exit -11 on a case with seqlen_k=1, c160da4)
#: is Triton's specialisation of seqlen_k to the constant 1; ``tma_applies`` now excludes one key.
TMA_TABLE: tuple[str, ...] = ("sm_90",)


#: Families whose table runs dense prefill on the Gluon kernel (``AttnConfig.wgmma``), as
#: ``{head_dim: (block_n, num_stages)}``. H200 session 10, TFLOP/s in the same run as cuDNN
#: (``results/attention-wgmma-pingpong-h200.json``): D=128 with 128-key tiles and 3 stages (224 KiB
#: of shared memory) 598 / 563 / 560 / 611 at 4k / 4k causal / 16k / 16k causal (attn_fwd 459 / 414 / 470 /
#: 465, cuDNN 682 / 526 / 623 / 570), 473 / 338 at 1k (397 / 288); 64-key tiles with 3 stages 510-530.
#: D=64 with 128-key tiles and 2 stages (``attention-wgmma-tiles-h200.json``, ``attention-wgmma-tiles-rerun-h200.json``) wins only without a mask from 4k keys
#: (430-462 vs 411-420); causal (357 vs 374-383 at 4k) and at 1k (322 vs 367-376) attn_fwd stays
#: (``WGMMA_D64_MIN_SEQLEN_K``). Session 14 (``attention-wgmma-kring-h200.json``): with each K stage released once the tile's
#: scores are done and K loaded a tile ahead of V, D=256 with 64-key tiles and 2 stages went from a tie with
#: attn_fwd (514 / 472 / 526 / 524, session 10) to 626 / 607 / 643 / 637 (cuDNN 643 / 585 / 657 / 616;
#: attn_fwd 518 / 455 / 535 / 528), 509 / 380 at 1k (cuDNN 595 / 467); a third K stage gained nothing
#: (617 / 548 / 644 / 633). D=128 with 2 stages 654 / 518 / 613 / 611 against 3 stages' 581 / 541 / 522 /
#: 583 (cuDNN 609 / 534 / 607 / 580), 468 / 336 vs 466 / 335 at 1k.
WGMMA_TABLE = {"sm_90": {128: (128, 2), 64: (128, 2), 256: (64, 2)}}
WGMMA_D64_MIN_SEQLEN_K = 4096
#: Shared memory the Gluon kernel needs beyond ``smem_bytes`` (its barriers and reduction scratch: 352 bytes
#: at D=128 with 128-key tiles and 3 stages, Triton 3.6), with margin; ``fit`` and ``check_wgmma`` add it.
WGMMA_SMEM_EXTRA = 1024
#: Fewer query rows than one program's 128 leave most of its rows idle: attn_fwd's smaller tiles serve those.
WGMMA_MIN_SEQLEN_Q = 128


def _wgmma_in_table(op, arch: str) -> tuple[int, int] | None:
    """``(block_n, num_stages)`` when the table runs ``op`` on the Gluon prefill kernel, else None."""
    from .attention_wgmma import blocker

    tiles = WGMMA_TABLE.get(arch, {}).get(op.head_dim)
    if tiles is None or op.seqlen_q < WGMMA_MIN_SEQLEN_Q or blocker(op, arch) is not None:
        return None
    if op.head_dim == 64 and (op.mask_mod is not None or op.seqlen_k < WGMMA_D64_MIN_SEQLEN_K):
        return None
    return tiles


def _tma_in_table(op, arch: str) -> bool:
    """Whether the table asks for TMA loads: dense fp16/bf16 prefill with D > 128 on ``TMA_TABLE``
    archs, head dims whose contiguous rows are whole 16-byte units (else every call would fall back)."""
    return (arch in TMA_TABLE and op.head_dim > 128 and op.head_dim % 8 == 0 and op.head_dim_v % 8 == 0
            and op.dtype.value in ("float16", "bfloat16"))


def fit(op, cfg: AttnConfig, arch: str) -> AttnConfig:
    """Shrink stages, then key tiles, then query tiles until the shared-memory estimate fits.

    A ``wgmma`` configuration keeps its key tile and ring depth where the Gluon kernel serves ``op``
    and becomes the ``attn_fwd`` table configuration elsewhere. Then clears ``tma`` where ``op`` or
    ``arch`` cannot use it (paged or varlen keys, packed decode tiles, one key, architectures without
    TMA), so a fitted configuration always passes ``check_tma``.
    """
    if cfg.decode_ws:
        from .attention_decode_ws import blocker as ws_blocker
        from .attention_decode_ws import smem_bytes as ws_smem

        if ws_blocker(op, arch, cfg.block_n) is not None:
            return choose(op, arch, wgmma=False)
        cfg = replace(cfg, num_warps=4, num_stages=max(2, cfg.num_stages), wgmma=False, tma=False,
                      lazy_rescale=False, k_stages=0)
        while ws_smem(op, cfg.block_n, cfg.num_stages) > SMEM_LIMIT[arch] - WGMMA_SMEM_EXTRA and cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        return cfg
    if cfg.wgmma:
        from .attention_wgmma import blocker

        if blocker(op, arch) is not None:
            return choose(op, arch, wgmma=False)
        cfg = replace(cfg, block_m=128, num_warps=4, num_stages=max(2, cfg.num_stages), pack=1, num_splits=1,
                      tma=False, lazy_rescale=False)
        limit = SMEM_LIMIT[arch] - WGMMA_SMEM_EXTRA
        if cfg.k_stages <= cfg.num_stages:          # 0, or no deeper than the V ring: one ring depth
            cfg = replace(cfg, k_stages=0)
        while smem_bytes(op, 128, cfg.block_n, cfg.num_stages, cfg.k_stages) > limit and cfg.k_stages:
            cfg = replace(cfg, k_stages=cfg.k_stages - 1 if cfg.k_stages - 1 > cfg.num_stages else 0)
        while smem_bytes(op, 128, cfg.block_n, cfg.num_stages) > limit and (cfg.num_stages > 2 or cfg.block_n > 32):
            shrink = {"num_stages": cfg.num_stages - 1} if cfg.num_stages > 2 else {"block_n": cfg.block_n // 2}
            cfg = replace(cfg, **shrink)
        return cfg
    cfg = _fit_smem(op, cfg, arch)
    if cfg.tma and (not tma_applies(op, cfg) or (arch != "interp" and arch not in TMA_ARCHS)):
        cfg = replace(cfg, tma=False)
    return cfg


def _fit_smem(op, cfg: AttnConfig, arch: str) -> AttnConfig:
    """Shrink stages, then key tiles, then query tiles until the shared-memory estimate fits."""
    limit = SMEM_LIMIT.get(arch, 99 * 1024) - 8 * 1024
    while smem_bytes(op, cfg.block_m, cfg.block_n, cfg.num_stages) > limit:
        if cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > max(16, next_pow2(cfg.pack)):
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        else:
            break
    return cfg


def query_tiles(op, cfg: AttnConfig) -> int:
    """Programs of one KV split: query tiles x head blocks (varlen: an upper bound, B + 1 extra)."""
    rows = cfg.block_m // cfg.pack
    if op.kv_layout.value == "varlen":
        return (-(-op.total_q // rows) + op.batch + 1) * (op.heads_q // cfg.pack)
    return -(-op.seqlen_q // rows) * (op.batch * op.heads_q // cfg.pack)


def num_splits(op, cfg: AttnConfig, num_sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """KV splits so that the grid fills ``per_sm * num_sms`` programs (1 for prefill).

    Bounded by ``MAX_SPLITS`` and by ``MIN_TILES_PER_SPLIT`` key tiles per split.
    """
    base = query_tiles(op, cfg)
    tiles = -(-op.seqlen_k // cfg.block_n)
    # rounded down: one program past a full wave costs a whole tile walk (H200, B=1 32k with 8 KV
    # heads: 17 splits = 136 programs on 132 SMs ran 49.7 us, 16 splits 42.9 us)
    want = max(1, per_sm * num_sms // base)
    # the kernel shares the tiles out evenly (floor / ceil), so any count up to tiles // MIN keeps
    # every split busy; before session 6 it gave each split cdiv(tiles, splits) and the count was
    # rounded to that (B=1 decode of 2049 keys in pages of 64: 6 splits of 8 wanted, 48 programs)
    return max(1, min(want, MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))


def workspace_bytes(op, cfg: AttnConfig) -> int:
    """Split-KV workspace, allocated once per compiled signature, device and CUDA stream (this is one set).

    ``4 * num_splits * R * Hq * (Dv + 1)`` bytes of float32 partials (output and LSE per split),
    ``R = B * Sq`` (``total_q`` for varlen), plus one int32 arrival counter per query tile
    (``query_tiles``; none on the Gluon decode kernel, ``decode_ws``). ``num_splits <= MAX_SPLITS`` and
    splitting only happens while the query tiles alone fill less than ``PROGRAMS_PER_SM`` x the
    multiprocessors, so it stays small: e.g. B=1, Hq=32, Dv=128, 32 splits: 516 KiB.
    """
    if cfg.num_splits == 1:
        return 0
    R = op.total_q if op.kv_layout.value == "varlen" else op.batch * op.seqlen_q
    counters = 0 if cfg.decode_ws else 4 * query_tiles(op, cfg)      # the Gluon decode merges in attn_combine
    return 4 * cfg.num_splits * R * op.heads_q * (op.head_dim_v + 1) + counters


# -- autotuning -----------------------------------------------------------------------------------

def autotune_enabled() -> bool:
    return os.environ.get("PORTAKERN_TRITON_AUTOTUNE", "") not in ("", "0")


def bucket(op) -> str:
    """Problem bucket for tuning results: shapes rounded to powers of two, whether a mask and a score_mod are
    given, and what decides which kernels serve the op beside them: the page size (the Gluon decode kernel's
    tiles must divide or be divided by it) and ``seqlens_k`` (the Gluon prefill kernel takes none). Ops of one
    bucket may still differ in what rules a cached winner out (the mask's form, the exact lengths):
    ``restore`` checks it."""
    return (f"{op.kv_layout.value}-d{op.head_dim}-dv{op.head_dim_v}-g{op.group_size}-{op.dtype.value}"
            f"-sq{next_pow2(op.seqlen_q)}-sk{next_pow2(op.seqlen_k)}-b{next_pow2(op.batch)}"
            f"-h{op.heads_q}-m{int(op.mask_mod is not None)}-s{int(op.score_mod is not None)}"
            f"-ps{op.page_size}-sl{int(op.has_seqlens_k)}")


def restore(op, arch: str, entry: dict) -> AttnConfig:
    """A cached winner of ``op``'s bucket as ``op``'s configuration on ``arch``. Raises ``TypeError`` for an entry
    of another shape and ``ValueError`` for a configuration ``op`` rules out (the checks ``attention.build`` makes:
    a Gluon kernel or TMA that does not serve it, ``pdl`` where it cannot run); ``autotune.cached_best`` takes
    either as a miss and times the bucket again, where the build would have failed the compile."""
    cfg = AttnConfig(**entry)
    check_pdl(cfg, arch)
    check_tma(op, cfg, arch)
    check_wgmma(op, cfg, arch)
    check_decode_ws(op, cfg, arch)
    return cfg


def candidates(op, arch: str, num_sms: int) -> list[AttnConfig]:
    """Configurations worth timing for ``op`` (the table's choice first)."""
    base = choose(op, arch, num_sms)
    out = [base]
    if base.pack > 1:
        # the table's kernel and, where that is the Gluon decode kernel, attn_fwd's configuration too
        bases = [base] + ([choose(op, arch, num_sms, wgmma=False)] if base.decode_ws else [])
        for b0 in bases:
            for bn, st, w in ((64, 3, 4), (64, 4, 4), (128, 4, 4), (128, 2, 4), (64, 2, 4)):
                c = fit(op, replace(b0, block_n=bn, num_stages=st, num_warps=w), arch)
                for splits in sorted({b0.num_splits, c.num_splits, max(1, b0.num_splits // 2), b0.num_splits * 2}):
                    n = min(MAX_SPLITS, max(1, splits))
                    cand = replace(c, num_splits=n, early_merge=c.early_merge and n > 1)
                    if cand not in out:
                        out.append(cand)
        # pdl as the table's (SPLIT_PDL_TABLE): checked on the H200 by the GPU tests and conformance
        return out
    out += [c for c in wgmma_candidates(op, arch) if c not in out]
    base = choose(op, arch, num_sms, wgmma=False)
    for bm, bn, w, st in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)):
        c = fit(op, replace(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st), arch)
        if c not in out:
            out.append(c)
    out += [replace(c, lazy_rescale=True) for c in [c for c in out if not c.wgmma][:2]]   # the conditional rescale
    for c in (replace(base, tma=True), replace(base, tma=False)):   # TMA loads on the table tile, both ways
        c = fit(op, c, arch)
        if c not in out:
            out.append(c)
    return out


#: The Gluon kernel's ``(block_n, num_stages)`` that autotuning and the benchmark sweep time
WGMMA_CANDIDATE_TILES = ((128, 3), (64, 3), (128, 2), (64, 4))


def wgmma_candidates(op, arch: str) -> list[AttnConfig]:
    """The Gluon kernel's tiles worth timing for ``op`` after ``fit`` (none where it does not serve ``op``)."""
    out: list[AttnConfig] = []
    for bn, st in WGMMA_CANDIDATE_TILES:
        c = fit(op, AttnConfig(128, bn, 4, st, wgmma=True), arch)
        if c.wgmma and c not in out:
            out.append(c)
    return out


def tuned(op, device, arch: str, num_sms: int, timer) -> AttnConfig:
    """The cached best configuration of ``op``'s bucket, timing ``candidates`` with ``timer(cfg) -> s``."""
    from .autotune import cached_best

    return cached_best("triton-attention", device, bucket(op), candidates(op, arch, num_sms), timer,
                       default=lambda: choose(op, arch, num_sms), restore=lambda d: restore(op, arch, d))
