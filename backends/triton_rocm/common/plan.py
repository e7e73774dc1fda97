"""The launch configuration of an op on a gfx target (or the interpreter), read from ``tuning.py``.

``target_of(device)`` names the table key of a device; ``attention(op, target)`` and ``gemv(layout, M, N, target,
dtype, prologue)`` return frozen plans holding everything a launch or a lowering needs: tiles, warps, pipeline
depth, splits and the HIP compile options.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import tuning


def target_of(device) -> str:
    """The ``tuning`` key of a ``portakern.Device``: "interp" on a CPU (Triton's interpreter), else its gfx arch
    without feature suffixes ("gfx942:sramecc+:xnack-" -> "gfx942")."""
    if device.type == "cpu":
        return "interp"
    return (device.arch or "").split(":")[0]


def compute_units(device, target: str) -> int:
    """Compute units of ``device`` when it says (``info["compute_units"]``), else the target's table figure."""
    try:
        return int(dict(device.info).get("compute_units", 0)) or tuning.TARGETS[target]["compute_units"]
    except ValueError:
        return tuning.TARGETS[target]["compute_units"]


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


# == attention =====================================================================================================

@dataclass(frozen=True)
class AttnPlan:
    """One ``attn_fwd`` launch configuration: ``block_m`` rows (``pack`` query heads of one KV head share a tile
    in decode), ``block_n`` keys per step, ``num_splits`` KV splits merged by ``attn_combine``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: int = 1
    num_splits: int = 1
    hip: dict = field(default_factory=dict, compare=False)


def _dtype_class(op) -> str:
    return "float32" if op.dtype.value == "float32" else "16-bit"


def _row(table, op, target: str) -> dict:
    d = max(op.head_dim, op.head_dim_v)
    for row in table:
        if row["target"] in (target, "any") and (target != "interp" or row["target"] == "interp") \
                and row["dtype"] in (_dtype_class(op), "any") and d <= row["max_d"]:
            return row
    raise LookupError(f"no row of the triton-rocm attention table matches target {target}, "
                      f"dtype {op.dtype.value}, D={d}")


def decode_rows(op) -> int | None:
    """Query rows per sequence when the G query heads of a KV head share one tile (decode and short windows),
    else None."""
    if op.group_size == 1:
        return None
    rows = -(-op.total_q // op.batch) if op.kv_layout.value == "varlen" else op.seqlen_q
    return rows if rows <= 16 and rows * op.group_size <= 128 else None


def lds_bytes(op, block_m: int, block_n: int, stages: int) -> int:
    """Estimate of the LDS a tile takes: ``stages`` K and V tiles plus the Q tile."""
    elt = 4 if op.dtype.value == "float32" else 2
    bd, bdv = max(16, next_pow2(op.head_dim)), max(16, next_pow2(op.head_dim_v))
    return stages * (bd + bdv) * block_n * elt + block_m * bd * elt


def query_tiles(op, plan: AttnPlan) -> int:
    """Programs of one KV split (varlen: an upper bound, B + 1 extra tiles)."""
    rows = plan.block_m // plan.pack
    if op.kv_layout.value == "varlen":
        return (-(-op.total_q // rows) + op.batch + 1) * (op.heads_q // plan.pack)
    return -(-op.seqlen_q // rows) * (op.batch * op.heads_q // plan.pack)


def attention(op, target: str, cus: int | None = None) -> AttnPlan:
    """The table's plan for ``op`` on ``target``, cut to the target's LDS, with its KV splits."""
    cus = cus or tuning.TARGETS[target]["compute_units"]
    rows = decode_rows(op)
    if rows is not None:
        row = _row(tuning.DECODE_TILES, op, target)
        block_n, warps, stages = row["tile"]
        pack = op.group_size
        block_m = min(max(16, next_pow2(rows * pack)), max(128, next_pow2(pack)))
    else:
        row = _row(tuning.PREFILL_TILES, op, target)
        block_m, block_n, warps, stages = row["tile"]
        pack = 1
        if op.kv_layout.value != "varlen":
            block_m = min(block_m, max(16, next_pow2(op.seqlen_q)))
    limit = tuning.TARGETS[target]["lds"]
    while lds_bytes(op, block_m, block_n, stages) > limit:
        if stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > max(16, next_pow2(pack)):
            block_m //= 2
        else:
            break
    plan = AttnPlan(block_m, block_n, warps, stages, pack, 1, dict(row["hip"]))
    per_cu = tuning.SPLIT_PROGRAMS_PER_CU["value"]
    tiles = -(-op.seqlen_k // block_n)
    want = max(1, per_cu * cus // query_tiles(op, plan))
    splits = max(1, min(want, tuning.MAX_SPLITS, tiles // tuning.MIN_TILES_PER_SPLIT))
    return AttnPlan(block_m, block_n, warps, stages, pack, splits, plan.hip)


def attention_workspace_bytes(op, plan: AttnPlan) -> int:
    """Split-KV workspace of one compiled signature: float32 partial outputs and LSEs of every split plus one
    int32 counter per query tile (0 without splits)."""
    if plan.num_splits == 1:
        return 0
    R = op.total_q if op.kv_layout.value == "varlen" else op.batch * op.seqlen_q
    return 4 * plan.num_splits * R * op.heads_q * (op.head_dim_v + 1) + 4 * query_tiles(op, plan)


# == quantized GEMV ================================================================================================

@dataclass(frozen=True)
class GemvPlan:
    """One GEMV launch configuration: ``kind`` "fma" (vector ALUs, small M) or "dot" (``tl.dot``: MFMA on CDNA),
    ``block_n`` rows of W and ``block_kw`` 32-bit words of K per program step, ``split_k`` K slices."""

    kind: str
    block_n: int
    block_kw: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    dq: int = 2
    hip: dict = field(default_factory=dict, compare=False)


def block_m(kind: str, M: int) -> int:
    """Rows of x per program: all of M up to 4 on the "fma" kernel, a 16-row tile on the "dot" kernel."""
    return min(next_pow2(M), 4) if kind == "fma" else 16


def gemv(layout, M: int, N: int, target: str, cus: int | None = None, prologue: str | None = None) -> GemvPlan:
    """The table's plan for a prepared weight ``layout`` (or its stand-in) at M rows of x on ``target``; an x
    ``prologue`` and per-element groups always take the "fma" kernel (the only one that reads them)."""
    cus = cus or (tuning.GEMV_INTERP_CUS if target == "interp" else tuning.TARGETS[target]["compute_units"])
    fma = prologue is not None or layout.per_elem_group or M <= tuning.FMA_MAX_M.get(target, 1)
    kind = "fma" if fma else "dot"
    for row in tuning.GEMV_TILES:
        if row["kind"] == kind and (row["target"] == target or (row["target"] == "any" and target != "interp")):
            break
    else:
        raise LookupError(f"no row of the triton-rocm GEMV table matches kind {kind!r} on {target}")
    bn, bkw, warps, stages = row["tile"]
    bkw, bn = min(next_pow2(bkw), 64), min(next_pow2(bn), 128)   # tiles of <= 128 rows divide the padded rows
    if kind == "dot":
        bkw, bn = max(16, bkw), max(16, bn)
    tiles_n, iters = -(-N // bn), -(-layout.KWP // bkw)
    want, split = tuning.PROGRAMS_PER_CU[kind] * cus, 1
    while tiles_n * split < want and split * 2 <= tuning.MAX_SPLIT_K and iters // 2 >= split * 2:
        split *= 2
    return GemvPlan(kind, bn, bkw, warps, stages, split, row["dq"], dict(row["hip"]))
