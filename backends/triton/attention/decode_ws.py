"""Host side of the Gluon split-KV decode kernel for sm_90 (``kernels/attention_decode_ws.py``).

``blocker(op, arch)`` says why an op cannot run on it (None when it can); ``call_blocker`` checks what
a signature cannot see (the views its 2-D TMA descriptors need, TMA's alignment rules); ``launcher``
returns the launch ``launch(q, k, v, out, lse, aux)`` for an ``AttnConfig`` (``block_n`` keys per
tile, ``num_stages`` ring stages, ``num_splits`` splits merged by ``attn_combine``); ``compile_for_target``
lowers the kernel without a GPU. It serves one query row per sequence (decode) over dense or paged
bf16/fp16 K/V with ``head_dim == head_dim_v`` in {64, 128, 256}, at most 64 query heads per KV head, a
positive scale, no score_mod, and no mask or the library's causal mask (which hides no key from the last
query row): ``gluon.scores_blocker``; pages of a multiple of 8 rows that divide or are divided by
the key tile.
"""

from __future__ import annotations

from typing import Any, Callable

from portakern.ir.ops import Attention, KVLayout

from ..common.launch import KERNEL_OPTIONS, KernelLaunch
from .combine import split_partials
from .gluon import lower_gluon, scores_blocker, smem_layout
from .specialise import launch_scalars
from .tma import tma_rules

QUERY_ROWS = 64          # the wgmma tile's rows: a program's query heads, then padding
PRODUCER_REGS = 40       # setmaxnreg of the load warp (a page id and box coordinates)


def box_rows(op: Attention, block_n: int) -> int:
    """Rows per TMA box: the key tile, or one page when pages are smaller."""
    return min(op.page_size, block_n) if op.kv_layout is KVLayout.PAGED else block_n


def blocker(op: Attention, arch: str, block_n: int = 64) -> str | None:
    """Why ``op`` cannot run on this kernel for ``arch`` with ``block_n``-key tiles (None when it can)."""
    if arch != "sm_90":
        return f"needs sm_90 (wgmma, TMA), not {arch}"
    if op.seqlen_q != 1 or op.kv_layout is KVLayout.VARLEN:
        return "one query row per sequence (decode) over dense or paged K/V only"
    why = scores_blocker(op)       # the library's causal mask hides no key from the last query row
    if why is not None:
        return why
    if op.group_size > QUERY_ROWS:
        return f"at most {QUERY_ROWS} query heads per KV head, not {op.group_size}"
    if op.kv_layout is KVLayout.PAGED:
        ps = op.page_size
        if ps % 8 or (ps % block_n and block_n % ps):
            return f"pages of a multiple of 8 rows dividing or divided by the {block_n}-key tile, not {ps}"
    if block_n not in (32, 64, 128):
        return f"block_n 32, 64 or 128, not {block_n}"
    return None


def call_blocker(q, k, v, out) -> str | None:
    """Why these tensors cannot go through the kernel's 2-D descriptors (None when they can): q as
    ``(B * HQ, D)`` and K/V as ``(rows, HKV * D)`` row-major views, TMA's alignment rules."""
    B, _, H, D = q.shape
    if q.stride(3) != 1 or q.stride(2) != D or (B > 1 and q.stride(0) != H * D):
        return f"q with strides {tuple(q.stride())} has no (B * HQ, D) view"
    for name, a in (("k", k), ("v", v)):
        X, S, H, D = a.shape
        if a.stride(3) != 1 or a.stride(2) != D or a.stride(1) != H * D or (X > 1 and a.stride(0) != S * H * D):
            return f"{name} with strides {tuple(a.stride())} has no (rows, HKV * D) view"
    for name, a in (("q", q), ("k", k), ("v", v)):
        why = tma_rules(name, a, a.stride()[:2])
        if why:
            return why
    if out.stride(3) != 1:
        return f"out with strides {tuple(out.stride())} (last stride must be 1)"
    return None


def descriptors(op: Attention, q, k, v, block_n: int):
    """2-D host descriptors: q over ``(B * HQ, D)`` in ``(64, D)`` blocks, K and V over ``(rows, HKV * D)``
    in ``(box_rows, D)`` blocks."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    D, pr, dt = op.head_dim, box_rows(op, block_n), op.dtype.value
    Bq, _, Hq, _ = q.shape
    qd = TensorDescriptor(q, [Bq * Hq, D], [D, 1], [QUERY_ROWS, D], smem_layout((QUERY_ROWS, D), dt))

    def kv(a):
        X, S, H, Da = a.shape
        return TensorDescriptor(a, [X * S, H * Da], [H * Da, 1], [pr, Da], smem_layout((pr, Da), dt))

    return qd, kv(k), kv(v)


def constexprs(op: Attention, cfg) -> dict[str, Any]:
    """The compile-time arguments of ``attn_decode_ws`` for ``op`` under ``cfg``."""
    paged = op.kv_layout is KVLayout.PAGED
    return dict(GROUP=op.group_size, BN=cfg.block_n, PR=box_rows(op, cfg.block_n), PAGE=op.page_size if paged else 1,
                D=op.head_dim, DV=op.head_dim_v, STAGES=cfg.num_stages, SPLITS=cfg.num_splits, PAGED=paged,
                HAS_SEQLENS=paged or op.has_seqlens_k, RETURN_LSE=op.return_lse, PRODUCER_REGS=PRODUCER_REGS,
                PDL=cfg.pdl, LAUNCH_MERGE=cfg.early_merge)


def _templates(descs: tuple) -> tuple | None:
    """``descs`` with their tensors dropped (held, they would keep the first call's KV cache alive), for
    ``_rebased``; None when the descriptor class keeps no ``__dict__`` to copy (then every call builds anew)."""
    if not all(hasattr(d, "__dict__") for d in descs):
        return None
    return tuple(_rebased(d, None) for d in descs)


def _rebased(template, a):
    """``template`` over tensor ``a``: the descriptor ``descriptors`` would build for ``a``, without its per-call
    validation. Valid because everything else a descriptor holds (shape, strides, box, layout) is fixed by the op
    and configuration for tensors that passed ``call_blocker``, which also checks TMA's alignment rules; a Gluon
    ``TensorDescriptor``'s own checks cost ~10 us a descriptor on the H200's host."""
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = a
    return d


def smem_bytes(op: Attention, block_n: int, stages: int) -> int:
    """Shared memory of the kernel: the query tile and ``stages`` K and V tiles (barriers aside)."""
    return 2 * (QUERY_ROWS * op.head_dim + stages * block_n * (op.head_dim + op.head_dim_v))


def launcher(op: Attention, cfg, combine_consts: dict[str, Any]) -> Callable[..., None]:
    """``launch(q, k, v, out, lse, aux)`` of the kernel for ``op`` under ``cfg``, for tensors that passed the
    backend's checks and ``call_blocker`` (``forward.build_gluon`` wraps it with both). With
    ``cfg.num_splits > 1`` the splits' partials go to a workspace (made on the first call per CUDA stream,
    ``stream_workspace``) that ``attn_combine`` (``combine_consts``) merges."""
    from portakern.stream_workspace import StreamWorkspace, stream_index

    from .. import kernels

    fn = kernels.load("attention_decode_ws").attn_decode_ws
    combine = kernels.load("attention_combine").attn_combine
    consts = constexprs(op, cfg)
    grid = (cfg.num_splits, op.batch * op.heads_kv)
    workspace: dict[Any, Any] = {}   # device -> StreamWorkspace
    # free_ints: the block table's strides follow its width (paged: one launcher serves every length)
    decode = KernelLaunch(fn, grid, consts, dict(num_warps=4, launch_pdl=cfg.pdl, **KERNEL_OPTIONS), free_ints=True)
    merge = KernelLaunch(combine, (op.batch * op.heads_q,), combine_consts,
                         dict(num_warps=4, launch_pdl=combine_consts["PDL"], **KERNEL_OPTIONS))

    kept: list = []   # [the templates, or None when descriptors cannot be rebased], decided on the first call

    def launch(q, k, v, out, lse, aux) -> None:
        if kept and kept[0] is not None:
            qd, kd, vd = (_rebased(t, a) for t, a in zip(kept[0], (q, k, v)))
        else:
            qd, kd, vd = descriptors(op, q, k, v, cfg.block_n)
            if not kept:
                kept.append(_templates((qd, kd, vd)))
        bt, sk = aux.get("block_table"), aux.get("seqlens_k")
        ws_o = ws_lse = None
        if cfg.num_splits > 1:
            ws = workspace.get(q.device)
            if ws is None:
                dev = q.device
                ws = workspace[dev] = StreamWorkspace(lambda: split_partials(op, cfg, op.batch, dev), stream_index(dev))
            ws_o, ws_lse = ws.get()
        sl = lse.stride() if lse is not None else (0, 0, 0)
        decode(qd, kd, vd, out, lse, ws_o, ws_lse, bt, sk, out.stride(0), out.stride(2), sl[0], sl[1],
               *(bt.stride() if bt is not None else (0, 0)), op.heads_q, k.shape[1], op.scale)
        if cfg.num_splits > 1:
            merge(ws_o, ws_lse, out, lse, *out.stride()[:3], *sl, 1, op.batch)

    return launch


def compile_for_target(op: Attention, cfg, cc: int) -> dict:
    """``{"attn_decode_ws": artifact}`` lowered for compute capability ``cc`` as a launch on contiguous
    tensors specialises it (``gluon.lower_gluon``)."""
    consts = constexprs(op, cfg)
    sc = launch_scalars(op)
    ints = dict(so_b=sc["stride_ob"], so_h=sc["stride_oh"], sl_b=sc["stride_lb"], sl_h=sc["stride_lh"],
                stride_btb=sc["stride_btb"], stride_btp=sc["stride_btp"], HQ=op.heads_q, seqlen_kv=op.shapes()["k"][1])
    split = cfg.num_splits > 1
    pointers = {"LSE": ("*fp32", op.return_lse), "WS_O": ("*fp32", split), "WS_LSE": ("*fp32", split),
                "BT": ("*i32", consts["PAGED"]), "SEQLENS_K": ("*i32", consts["HAS_SEQLENS"])}
    return lower_gluon("attention_decode_ws", "attn_decode_ws", op, descriptors, cfg.block_n, consts, pointers, ints,
                       cc, warps=8)
