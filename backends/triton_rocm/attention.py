"""The triton-rocm attention lowering: ``supports``, ``compile``, ``compile_for_target``.

One kernel body, the triton backend's ``attn_fwd`` (``kernels/attention_fwd.py`` there), serves prefill and
decode over dense, paged and varlen KV with every score / mask modification (``expr_triton``); KV splits merge
in a separate ``attn_combine`` launch. What the NVIDIA tables add on sm_90+ is never chosen here: the Gluon
wgmma prefill and warp-specialised decode kernels, TMA descriptors and programmatic dependent launch
(``PDL``/``TMA`` constexprs are False, the fused merge's spin on arrival counters is off). ``tl.dot`` lowers to
MFMA instructions on CDNA (``matrix_instr_nonkdim`` in ``tuning.py``).

What the two kernels take from a host -- their compile-time arguments, the index arrays each KV layout reads, the
per-call operand checks and the kernel's limits -- is written once beside them
(``portakern.backends.triton.kernels.attention_args``); this module supplies this backend's plan and its launch
(``common/launch.py``: Triton's own launch path with the HIP compile options) and lowering (``common/hip.py``).

Split-KV workspace: allocated once per compiled signature, device and stream (``portakern.stream_workspace``):
``4 * num_splits * R * Hq * (Dv + 1)`` bytes with ``R = B * Sq`` (``total_q`` for varlen), plus one int32 per
query tile (``plan.attention_workspace_bytes``).
"""

from __future__ import annotations

from typing import Any, Callable

from portakern.backend import YES, Support, no
from portakern.backends.triton.kernels import attention_args as args
from portakern.devices import Device
from portakern.ir.ops import Attention, KVLayout

from . import tuning
from .common import plan as plans
from .common.launch import Launch, compile_options


def supports(op: Attention, device: Device) -> Support:
    """Whether ``op`` can run on ``device``: the kernel's limits (``kernels.attention_args.refusal``: head dims up
    to 256, the grid's bounds, an expression Triton can spell, the interpreter on a CPU) on this backend's plan; a
    target without a table row is refused by the backend."""
    why = args.refusal(op, device, "triton-rocm", lambda: plans.attention(op, plans.target_of(device)).pack,
                       "at most")
    return no(why) if why else YES


def constexprs(op: Attention, plan: plans.AttnPlan, interpret: bool, mods) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd`` for ``op`` under ``plan`` (``mods``: the generated module of
    ``op``'s expressions): the NVIDIA-only switches (PDL, TMA, the fused merge, lazy rescaling) stay off, and
    ``tl.dot``'s fp32 precision is the table's (``tuning.DOT_PRECISION``)."""
    return args.fwd_constexprs(op, mods, interpret, block_m=plan.block_m, block_n=plan.block_n, pack=plan.pack,
                               num_splits=plan.num_splits, dot_prec=tuning.DOT_PRECISION["value"])


def combine_constexprs(op: Attention, plan: plans.AttnPlan) -> dict[str, Any]:
    """The compile-time arguments of ``attn_combine`` (the split-KV merge; no dependent-launch switches)."""
    return args.combine_constexprs(op, plan.num_splits, max(16, plans.next_pow2(op.head_dim_v)))


def grid(op: Attention, plan: plans.AttnPlan) -> tuple[int, int]:
    """``attn_fwd``'s grid: query tiles x splits, then (batch x) head groups."""
    rows = plan.block_m // plan.pack
    if op.kv_layout is KVLayout.VARLEN:
        return (-(-op.total_q // rows) + op.batch + 1) * plan.num_splits, op.heads_q // plan.pack
    return -(-op.seqlen_q // rows) * plan.num_splits, op.batch * op.heads_q // plan.pack


def compile(op: Attention, device: Device) -> Callable[..., None]:
    """The kernel ``kernel(q, k, v, out, lse, aux)`` for ``op`` on ``device`` (the table's plan)."""
    target = plans.target_of(device)
    return build(op, device, plans.attention(op, target, plans.compute_units(device, target)))


def build(op: Attention, device: Device, plan: plans.AttnPlan) -> Callable[..., None]:
    """The kernel for ``op`` under an explicit ``plan``."""
    import torch

    from portakern.stream_workspace import StreamWorkspace, stream_index

    from . import kernels
    from .expr_triton import load_mods

    interpret = kernels.interpreted()
    consts = constexprs(op, plan, interpret, load_mods(op.score_mod, op.mask_mod, interpret))
    shapes = op.shapes()
    varlen = op.kv_layout is KVLayout.VARLEN
    R = op.total_q if varlen else op.batch * op.seqlen_q
    g = grid(op, plan)
    fwd = Launch(kernels.load("attention_fwd").attn_fwd, g, consts,
                 compile_options(plan.num_warps, plan.num_stages, plan.hip), interpret)
    merge = Launch(kernels.load("attention_combine").attn_combine, (R * op.heads_q,), combine_constexprs(op, plan),
                   compile_options(4, 1, {}), interpret)
    workspace: dict[Any, StreamWorkspace] = {}

    def make(dev):
        f32 = dict(dtype=torch.float32, device=dev)
        return (torch.empty((plan.num_splits, R, op.heads_q, op.head_dim_v), **f32),
                torch.empty((plan.num_splits, R, op.heads_q), **f32),
                torch.zeros(g[0] // plan.num_splits * g[1], dtype=torch.int32, device=dev))

    def kernel(q, k, v, out, lse, aux=None) -> None:
        aux = args.unit_stride_aux(aux or {})
        bt, sk, cu_q, cu_k = (aux.get(n) for n in args.AUX_NAMES)
        args.check_operands(op, shapes, q, k, v, out, lse, backend="triton-rocm")
        args.check_aux(op, bt, sk, cu_q, cu_k)
        if varlen:
            strides = [(0,) + t.stride()[:2] for t in (q, k, v, out)]
            sl = (0,) + (lse.stride() if lse is not None else (0, 0))
        else:
            strides = [t.stride()[:3] for t in (q, k, v, out)]
            sl = lse.stride() if lse is not None else (0, 0, 0)
        sbt = bt.stride() if bt is not None else (0, 0)
        ws_o = ws_lse = locks = None
        if plan.num_splits > 1:
            ws = workspace.get(q.device)
            if ws is None:
                dev = q.device
                ws = workspace[dev] = StreamWorkspace(lambda: make(dev), stream_index(dev))
            ws_o, ws_lse, locks = ws.get()
        fwd(q, k, v, out, lse, ws_o, ws_lse, locks, bt, sk, cu_q, cu_k, None, None,
            *strides[0], *strides[1], *strides[2], *strides[3], *sl, *sbt,
            op.batch, op.total_q if varlen else op.seqlen_q, op.seqlen_k, R, op.scale)
        if plan.num_splits > 1:
            merge(ws_o, ws_lse, out, lse, *strides[3], *sl, op.seqlen_q, R)

    kernel.__name__ = f"triton_rocm_attention_{op.content_hash()}"
    kernel.config = plan
    kernel.workspace_bytes = plans.attention_workspace_bytes(op, plan)
    return kernel


def compile_for_target(op: Attention, target: str) -> dict:
    """``op`` lowered for ``target`` ("gfx942", "gfx950") to hsaco with Triton's HIP backend, no GPU needed.

    Returns ``{"target", "config", "kernels": {name: {"hsaco", "amdgcn", "shared", "num_warps", "options"}}}``:
    ``attn_fwd`` and, when the plan splits the keys, ``attn_combine``.
    """
    from dataclasses import asdict

    from .common.hip import POINTER, check_target, compiler_kernel, lower
    from .expr_triton import load_mods

    check_target(target)
    plan = plans.attention(op, target)
    fwd = compiler_kernel("attention_fwd", "attn_fwd")
    mods = load_mods(op.score_mod, op.mask_mod, False)
    consts = constexprs(op, plan, False, mods)
    t = POINTER[op.dtype.value]
    varlen, paged = op.kv_layout is KVLayout.VARLEN, op.kv_layout is KVLayout.PAGED
    none = {"K_DESC": None, "V_DESC": None}
    if plan.num_splits == 1:
        none.update(WS_O=None, WS_LSE=None, LOCKS=None)
    if not op.return_lse:
        none["LSE"] = None
    if not paged:
        none["BLOCK_TABLE"] = None
    if not op.has_seqlens_k:
        none["SEQLENS_K"] = None
    if not varlen:
        none.update(CU_Q=None, CU_K=None)
    pointers = {"Q": t, "K": t, "V": t, "O": t, "LSE": "*fp32", "WS_O": "*fp32", "WS_LSE": "*fp32",
                "LOCKS": "*i32", "BLOCK_TABLE": "*i32", "SEQLENS_K": "*i32", "CU_Q": "*i32", "CU_K": "*i32",
                "scale": "fp32"}
    aligned = set(pointers) - {"scale"}
    out = {"target": target, "config": asdict(plan), "kernels": {}}
    out["kernels"]["attn_fwd"] = lower(fwd, target, pointers, {**consts, **none}, aligned,
                                       plan.num_warps, plan.num_stages, plan.hip)
    if plan.num_splits > 1:
        comb = compiler_kernel("attention_combine", "attn_combine")
        cptrs = {"WS_O": "*fp32", "WS_LSE": "*fp32", "O": t, "LSE": "*fp32"}
        cnone = {} if op.return_lse else {"LSE": None}
        out["kernels"]["attn_combine"] = lower(comb, target, cptrs, {**combine_constexprs(op, plan), **cnone},
                                               set(cptrs), 4, 1, {})
    return out
