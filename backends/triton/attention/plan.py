"""The table's configuration of an attention op: which kernel, which tile, how many KV splits.

``choose(op, arch, num_sms)`` reads ``tuning.py``'s attention tables for the architecture family (see
``common/arch.py``); ``fit`` shrinks any configuration until it fits the family's shared memory and passes the
rules of ``config.py``; ``num_splits`` and ``workspace_bytes`` size split-KV decode.
"""

from __future__ import annotations

from dataclasses import replace

from .. import tuning
from ..common.arch import TMA_ARCHS, default_sms, device_family
from . import decode_ws, wgmma
from .config import AttnConfig, next_pow2, smem_bytes, tma_applies


def family(device) -> tuple[str, int]:
    """``(architecture family, multiprocessors)`` of ``device`` for the attention tables (the interpreter's runs
    stand for ``tuning.ATTENTION_INTERP_SMS``)."""
    return device_family(device, tuning.ATTENTION_INTERP_SMS)


def for_device(op, device) -> AttnConfig:
    """The table configuration of ``op`` on ``device``."""
    return choose(op, *family(device))


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


def _dtype_class(op) -> str:
    return "float32" if op.dtype.value == "float32" else "16-bit"


def _row(table, arch: str, op, **keys):
    """The first row of ``table`` whose family (or "any"), dtype class (or "any"), ``max_d`` bound and ``keys``
    (each equal, or "any") match ``op`` on ``arch``."""
    d, dt = max(op.head_dim, op.head_dim_v), _dtype_class(op)
    for row in table:
        if row["family"] in (arch, "any") and row["dtype"] in (dt, "any") and d <= row["max_d"] \
                and all(row[k] in (v, "any") for k, v in keys.items()):
            return row
    raise LookupError(f"no row of the attention table matches family {arch}, dtype {dt}, D={d}, {keys}")


def prefill_tile(op, arch: str) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` of a prefill tile, before fitting (``tuning.PREFILL_TILES``)."""
    return _row(tuning.PREFILL_TILES, arch, op)["tile"]


def decode_tile(op, arch: str) -> tuple[int, int, int]:
    """``(block_n, num_warps, num_stages)`` of a packed decode tile (``tuning.DECODE_TILES``)."""
    return _row(tuning.DECODE_TILES, arch, op, layout=op.kv_layout.value)["tile"]


def _wgmma_in_table(op, arch: str) -> tuple[int, int] | None:
    """``(block_n, num_stages)`` when the table runs ``op`` on the Gluon prefill kernel, else None."""
    tiles = next((r["tile"] for r in tuning.WGMMA_TILES if r["family"] == arch and r["head_dim"] == op.head_dim), None)
    if tiles is None or op.seqlen_q < tuning.WGMMA_MIN_SEQLEN_Q or wgmma.blocker(op, arch) is not None:
        return None
    if op.head_dim == 64 and (op.mask_mod is not None or op.seqlen_k < tuning.WGMMA_D64_MIN_SEQLEN_K):
        return None
    return tiles


def _tma_in_table(op, arch: str) -> bool:
    """Whether the table asks for TMA loads: dense fp16/bf16 prefill with D > 128 on ``tuning.TMA_PREFILL``
    families, head dims whose contiguous rows are whole 16-byte units (else every call would fall back)."""
    return (arch in tuning.TMA_PREFILL and op.head_dim > 128 and op.head_dim % 8 == 0 and op.head_dim_v % 8 == 0
            and op.dtype.value in ("float16", "bfloat16"))


def choose(op, arch: str, num_sms: int | None = None, wgmma: bool = True) -> AttnConfig:
    """The table configuration for ``op`` on architecture family ``arch`` (``common.arch.arch_family``);
    ``wgmma=False``: the ``attn_fwd`` configuration even where the table runs a Gluon kernel (the
    prefill kernel, ``wgmma``, or the decode kernel, ``decode_ws``)."""
    num_sms = num_sms or (tuning.ATTENTION_INTERP_SMS if arch == "interp" else default_sms(arch))
    G = op.group_size
    rows = decode_rows(op)
    tiles = _wgmma_in_table(op, arch) if wgmma and rows is None else None
    if tiles:
        return AttnConfig(128, tiles[0], 4, tiles[1], wgmma=True)
    if rows is not None:
        pack = G
        block_m = min(max(16, next_pow2(rows * G)), max(128, next_pow2(G)))
        block_n, warps, stages = decode_tile(op, arch)
    else:
        pack = 1
        block_m, block_n, warps, stages = prefill_tile(op, arch)
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
                       release_next=splits > 1 and arch in tuning.RELEASE_NEXT,
                       early_merge=splits > 1 and arch in tuning.EARLY_MERGE)
    fused = arch in tuning.FUSED_COMBINE
    return replace(cfg, num_splits=splits, fused_combine=fused, pdl=splits > 1 and arch in tuning.SPLIT_PDL)


def _split_paged(op, cfg: AttnConfig, arch: str, num_sms: int, splits: int,
                 gluon: bool = True) -> tuple[AttnConfig, int]:
    """Kernel, tile and split count of paged decode whose keys are split (``tuning.SPLIT_PAGED_WS`` where the
    Gluon decode kernel serves ``op`` and ``gluon``, else ``SPLIT_PAGED_TILE``, else ``SPLIT_PAGED_BN``);
    once the grid is full, the fewest splits with the same longest split."""
    ws = tuning.SPLIT_PAGED_WS.get(arch) if gluon else None
    tile = tuning.SPLIT_PAGED_TILE.get(arch) if op.dtype.value != "float32" else None
    per_sm_default = tuning.SPLIT_PROGRAMS_PER_SM["value"]
    if ws and decode_ws.blocker(op, arch, ws["tile"][0]) is None:
        bn, stages = ws["tile"]
        cfg = fit(op, replace(cfg, block_n=bn, num_stages=stages, num_warps=4, decode_ws=True), arch)
        per_sm = per_sm_default
    elif tile:
        bn, stages, per_sm = tile["tile"]
        cfg = fit(op, replace(cfg, block_n=bn, num_stages=stages), arch)
        if per_sm * smem_bytes(op, cfg.block_m, cfg.block_n, cfg.num_stages) > tuning.SMEM_LIMIT.get(arch, 0):
            per_sm = per_sm_default                 # their rings would not fit one SM together
    else:
        entry = tuning.SPLIT_PAGED_BN.get(arch)
        bn, per_sm = (entry["block_n"] if entry else cfg.block_n), per_sm_default
        if not (bn < cfg.block_n and op.page_size % bn == 0):
            return cfg, splits
        cfg = fit(op, replace(cfg, block_n=bn), arch)
    splits = num_splits(op, cfg, num_sms, per_sm)
    if splits == per_sm * num_sms // query_tiles(op, cfg):
        # the grid is full: the fewest splits with the same longest split (32, not 33, at 32k keys)
        tiles = -(-op.seqlen_k // cfg.block_n)
        splits = -(-tiles // -(-tiles // splits))
    return cfg, splits


def fit(op, cfg: AttnConfig, arch: str) -> AttnConfig:
    """Shrink stages, then key tiles, then query tiles until the shared-memory estimate fits.

    A ``wgmma`` configuration keeps its key tile and ring depth where the Gluon kernel serves ``op``
    and becomes the ``attn_fwd`` table configuration elsewhere (likewise ``decode_ws``). Then clears ``tma``
    where ``op`` or ``arch`` cannot use it (paged or varlen keys, packed decode tiles, one key, architectures
    without TMA), so a fitted configuration always passes ``config.check_tma``.
    """
    if cfg.decode_ws:
        if decode_ws.blocker(op, arch, cfg.block_n) is not None:
            return choose(op, arch, wgmma=False)
        cfg = replace(cfg, num_warps=4, num_stages=max(2, cfg.num_stages), wgmma=False, tma=False,
                      lazy_rescale=False, k_stages=0)
        limit = tuning.SMEM_LIMIT[arch] - tuning.WGMMA_SMEM_EXTRA
        while decode_ws.smem_bytes(op, cfg.block_n, cfg.num_stages) > limit and cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        return cfg
    if cfg.wgmma:
        if wgmma.blocker(op, arch) is not None:
            return choose(op, arch, wgmma=False)
        cfg = replace(cfg, block_m=128, num_warps=4, num_stages=max(2, cfg.num_stages), pack=1, num_splits=1,
                      tma=False, lazy_rescale=False)
        limit = tuning.SMEM_LIMIT[arch] - tuning.WGMMA_SMEM_EXTRA
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
    limit = tuning.SMEM_LIMIT.get(arch, 99 * 1024) - 8 * 1024
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


def num_splits(op, cfg: AttnConfig, num_sms: int, per_sm: int | None = None) -> int:
    """KV splits so that the grid fills ``per_sm * num_sms`` programs (1 for prefill); ``per_sm`` defaults to
    ``tuning.SPLIT_PROGRAMS_PER_SM``.

    Bounded by ``tuning.MAX_SPLITS`` and by ``tuning.MIN_TILES_PER_SPLIT`` key tiles per split.
    """
    per_sm = tuning.SPLIT_PROGRAMS_PER_SM["value"] if per_sm is None else per_sm
    base = query_tiles(op, cfg)
    tiles = -(-op.seqlen_k // cfg.block_n)
    # rounded down: one program past a full wave costs a whole tile walk (H200, B=1 32k with 8 KV
    # heads: 17 splits = 136 programs on 132 SMs ran 49.7 us, 16 splits 42.9 us)
    want = max(1, per_sm * num_sms // base)
    # the kernel shares the tiles out evenly (floor / ceil), so any count up to tiles // MIN keeps every split
    # busy (with equal shares of cdiv(tiles, splits), B=1 decode of 2049 keys in pages of 64 got 6 splits, not 8)
    return max(1, min(want, tuning.MAX_SPLITS, tiles // tuning.MIN_TILES_PER_SPLIT))


def workspace_bytes(op, cfg: AttnConfig) -> int:
    """Split-KV workspace, allocated once per compiled signature, device and CUDA stream (this is one set).

    ``4 * num_splits * R * Hq * (Dv + 1)`` bytes of float32 partials (output and LSE per split),
    ``R = B * Sq`` (``total_q`` for varlen), plus one int32 arrival counter per query tile
    (``query_tiles``; none on the Gluon decode kernel, ``decode_ws``). ``num_splits <= tuning.MAX_SPLITS`` and
    splitting only happens while the query tiles alone fill less than ``tuning.SPLIT_PROGRAMS_PER_SM`` x the
    multiprocessors, so it stays small: e.g. B=1, Hq=32, Dv=128, 32 splits: 516 KiB.
    """
    if cfg.num_splits == 1:
        return 0
    R = op.total_q if op.kv_layout.value == "varlen" else op.batch * op.seqlen_q
    counters = 0 if cfg.decode_ws else 4 * query_tiles(op, cfg)      # the Gluon decode merges in attn_combine
    return 4 * cfg.num_splits * R * op.heads_q * (op.head_dim_v + 1) + counters
