"""The triton-rocm attention lowering: ``supports``, ``compile``, ``compile_for_target``.

One kernel body, the triton backend's ``attn_fwd`` (``kernels/attention_fwd.py`` there), serves prefill and
decode over dense, paged and varlen KV with every score / mask modification (``expr_triton``); KV splits merge
in a separate ``attn_combine`` launch. What the NVIDIA tables add on sm_90+ is never chosen here: the Gluon
wgmma prefill and warp-specialised decode kernels, TMA descriptors and programmatic dependent launch
(``PDL``/``TMA`` constexprs are False, the fused merge's spin on arrival counters is off). ``tl.dot`` lowers to
MFMA instructions on CDNA (``matrix_instr_nonkdim`` in ``tuning.py``).

Split-KV workspace: allocated once per compiled signature, device and stream (``portakern.stream_workspace``):
``4 * num_splits * R * Hq * (Dv + 1)`` bytes with ``R = B * Sq`` (``total_q`` for varlen), plus one int32 per
query tile (``plan.attention_workspace_bytes``).
"""

from __future__ import annotations

from typing import Any, Callable

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir.ops import Attention, KVLayout

from . import tuning
from .common import plan as plans
from .common.launch import Launch, compile_options

MAX_HEAD_DIM = 256
#: The grid's second axis: HIP allows 65536 blocks there on CDNA; 65535 keeps the CUDA bound the kernels share.
MAX_GRID_Y = 65535
MAX_VARLEN_BATCH = 1 << 14
AUX_NAMES = ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
_LAYOUT = {KVLayout.DENSE: 0, KVLayout.PAGED: 1, KVLayout.VARLEN: 2}


def supports(op: Attention, device: Device) -> Support:
    """Whether ``op`` can run on ``device``: head dims up to 256, the grid's bounds, an expression Triton can
    spell, a target with a table row (checked by the backend), the interpreter on a CPU."""
    from . import kernels

    where = f"triton-rocm on {device.arch or device.type}"
    for name, value in (("head_dim", op.head_dim), ("head_dim_v", op.head_dim_v)):
        if value > MAX_HEAD_DIM:
            return no(f"attention({name}={value}) is not supported by {where}: head dimensions up to "
                      f"{MAX_HEAD_DIM} fit the kernel's tiles; pass backend=\"cpu\" or split the head dimension")
    if device.type == "cpu" and not kernels.interpreted():
        return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run here; "
                  "set TRITON_INTERPRET=1 before the first import of triton")
    plan = plans.attention(op, plans.target_of(device))
    if op.kv_layout is KVLayout.VARLEN:
        if op.batch >= MAX_VARLEN_BATCH:
            return no(f"varlen attention with batch={op.batch} is not supported by {where}: at most "
                      f"{MAX_VARLEN_BATCH - 1} sequences per call; split the batch")
        grid_y = op.heads_q // plan.pack
    else:
        grid_y = op.batch * op.heads_q // plan.pack
    if grid_y > MAX_GRID_Y:
        return no(f"attention with batch x heads = {grid_y} programs on the grid's second axis is not supported "
                  f"by {where} (at most {MAX_GRID_Y}); split the batch")
    try:
        from .expr_triton import generate_source

        generate_source(op.score_mod, op.mask_mod)
    except UnsupportedError as e:
        return no(f"{e}; pass backend=\"cpu\"")
    return YES


def constexprs(op: Attention, plan: plans.AttnPlan, interpret: bool, mods) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd`` for ``op`` under ``plan`` (``mods``: the generated module of
    ``op``'s expressions). NVIDIA-only switches (PDL, TMA, the fused merge, lazy rescaling) are off."""
    from .expr_triton import analyse_mask

    bounds = analyse_mask(op.mask_mod)
    return dict(
        SCORE_MOD=mods.score_mod, MASK_MOD=mods.mask_mod,
        HQ=op.heads_q, GROUP=op.group_size, PACK=plan.pack,
        D=op.head_dim, DV=op.head_dim_v,
        BLOCK_D=max(16, plans.next_pow2(op.head_dim)), BLOCK_DV=max(16, plans.next_pow2(op.head_dim_v)),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        LAYOUT=_LAYOUT[op.kv_layout], HAS_SEQLENS=op.has_seqlens_k, PAGE_SIZE=max(1, op.page_size),
        BATCH_P2=plans.next_pow2(op.batch + 1) if op.kv_layout is KVLayout.VARLEN else 1,
        NUM_SPLITS=plan.num_splits, FUSED_COMBINE=False,
        HAS_LEFT=bounds.left is not None, WIN_LEFT=bounds.left or 0,
        HAS_RIGHT=bounds.right is not None, WIN_RIGHT=bounds.right or 0,
        HAS_MASK=op.mask_mod is not None, MASK_ALL=bounds.residual, NEVER=bounds.never,
        HAS_SCORE_MOD=op.score_mod is not None, RETURN_LSE=op.return_lse,
        UPCAST=interpret and op.dtype.value == "bfloat16",
        DOT_PREC=tuning.DOT_PRECISION["value"],
        PDL=False, LAZY_RESCALE=False, TMA=False,
        RAW_MAX=op.score_mod is None and op.scale > 0,
    )


def combine_constexprs(op: Attention, plan: plans.AttnPlan) -> dict[str, Any]:
    """The compile-time arguments of ``attn_combine`` (the split-KV merge)."""
    return dict(HQ=op.heads_q, DV=op.head_dim_v, BLOCK_DV=max(16, plans.next_pow2(op.head_dim_v)),
                NUM_SPLITS=plan.num_splits, SPLITS_P2=plans.next_pow2(plan.num_splits),
                VARLEN=op.kv_layout is KVLayout.VARLEN, RETURN_LSE=op.return_lse, PDL=False, RELEASE=False,
                EARLY=False)


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
        aux = _unit_stride(aux or {})
        bt, sk, cu_q, cu_k = (aux.get(n) for n in AUX_NAMES)
        check_operands(op, shapes, q, k, v, out, lse)
        check_aux(op, bt, sk, cu_q, cu_k)
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


def _unit_stride(aux: dict) -> dict:
    """``aux`` with its 1-D index arrays at unit stride, as the kernel reads them (a strided view is copied)."""
    for name in AUX_NAMES[1:]:
        a = aux.get(name)
        if a is not None and a.shape[0] > 1 and a.stride(0) != 1:
            aux = dict(aux, **{name: a.contiguous()})
    return aux


def check_operands(op: Attention, shapes: dict, q, k, v, out, lse) -> None:
    """Raise ``InvalidInputError`` for an operand of another dtype or shape than the op's, or a last dimension
    that is not contiguous."""
    want = op.dtype.value
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if str(a.dtype).rpartition(".")[2] != want:
            raise InvalidInputError(f"{name} has dtype {a.dtype}, but this attention op was compiled for {want}; "
                                    f"pass {want} arrays or compile the op for {a.dtype}")
        if tuple(a.shape) != shapes[name]:
            raise InvalidInputError(f"{name} has shape {tuple(a.shape)}, expected {shapes[name]} for this "
                                    f"{op.kv_layout.value} attention op")
        if a.shape[-1] > 1 and a.stride(-1) != 1:
            raise InvalidInputError(f"{name} has stride {a.stride(-1)} in its last dimension: the triton-rocm "
                                    f"backend needs it contiguous; pass {name}.contiguous()")
    if op.return_lse and (lse is None or tuple(lse.shape) != shapes["lse"]
                          or str(lse.dtype).rpartition(".")[2] != "float32"):
        raise InvalidInputError(f"lse must be a float32 array of shape {shapes['lse']} when return_lse=True")


def check_aux(op: Attention, bt, sk, cu_q, cu_k) -> None:
    """Raise unless the call passes exactly the index arrays ``op``'s KV layout reads."""
    lay = op.kv_layout
    need = {"block_table": lay is KVLayout.PAGED, "seqlens_k": op.has_seqlens_k,
            "cu_seqlens_q": lay is KVLayout.VARLEN, "cu_seqlens_k": lay is KVLayout.VARLEN}
    for name, a in zip(AUX_NAMES, (bt, sk, cu_q, cu_k)):
        if need[name] and a is None:
            raise InvalidInputError(f"aux[{name!r}] is missing: this {lay.value} attention op needs it")
        if not need[name] and a is not None:
            raise InvalidInputError(f"aux[{name!r}] was given but this {lay.value} attention op does not read it")


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
