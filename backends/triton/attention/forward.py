"""The attention launcher: ``build(op, device, cfg)`` returns ``kernel(q, k, v, out, lse, aux)``.

One kernel (``kernels/attention_fwd.py``) serves prefill and decode over dense, paged and varlen KV;
``kernels/attention_combine.py`` merges KV splits (``combine.py``). ``score_mod`` / ``mask_mod`` are lowered to
Triton source by ``expr_triton`` and passed to the kernel as constexpr functions; library causal/window terms of
the mask are recognised so key tiles outside them are skipped.

On sm_90 the table runs dense bf16/fp16 prefill at head dims 64, 128 and 256 on a second kernel,
``kernels/attention_wgmma.py`` (Gluon: a TMA load warp and two consumer warpgroups with their own
schedule; host side ``wgmma.py``, ``AttnConfig.wgmma``, table ``tuning.WGMMA_TILES``), and split paged decode
on a third, ``kernels/attention_decode_ws.py`` (Gluon: a load warp that reads the block table and copies K/V
pages by TMA, one consumer warpgroup; host side ``decode_ws.py``, ``AttnConfig.decode_ws``, table
``tuning.SPLIT_PAGED_WS``; its splits always merge in ``attn_combine``). ``build_gluon`` puts either behind
``attn_fwd``'s per-call checks.

Split-KV workspace: allocated once per compiled signature, device and CUDA stream (``stream_workspace``: a
capture takes an existing set) and kept in the kernel's closure: ``4 * num_splits * R * Hq * (Dv + 1)`` bytes
with ``R = B * Sq`` (``total_q`` for varlen), plus one int32 arrival counter per query tile for ``attn_fwd``
(``plan.workspace_bytes``; ``num_splits <= tuning.MAX_SPLITS``).

TMA (``AttnConfig.tma``, dense prefill on sm_90+): K and V go to the kernel as host-side ``TensorDescriptor``s
(``tma.descriptors``), built per call. A call whose tensors break TMA's rules (``tma.tma_blocker``) runs the
pointer kernel instead, compiled on its first such call, with a RuntimeWarning naming the reason; the results
are the same, only the speed differs.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable

from portakern.devices import Device
from portakern.ir.ops import Attention, KVLayout
from portakern.lru import LRU
from portakern.stream_workspace import StreamWorkspace, stream_index

from ..common.launch import KERNEL_OPTIONS, KernelLaunch
from ..kernels.attention_args import fwd_constexprs
from . import combine, decode_ws, plan, wgmma
from .checks import AUX_NAMES, check_aux, check_operands, layout_key, unit_stride_aux
from .config import AttnConfig, Lengths, next_pow2
from .rules import check
from .tma import descriptors, tma_blocker

#: split-KV workspace sets a built kernel keeps (one per device, rows and grid, least recently used first out)
WORKSPACE_SETS = 4


def constexprs(op: Attention, cfg: AttnConfig, interpret: bool, mods) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd`` for ``op`` under ``cfg`` (``mods``: the generated module of
    ``op``'s score_mod and mask_mod, ``expr_triton.load_mods``): ``kernels.attention_args.fwd_constexprs`` with
    the configuration's switches, and tf32 ``tl.dot`` inputs unless the op is fp32."""
    return fwd_constexprs(op, mods, interpret, block_m=cfg.block_m, block_n=cfg.block_n, pack=cfg.pack,
                          num_splits=cfg.num_splits, dot_prec="ieee" if op.dtype.value == "float32" else "tf32",
                          fused_combine=cfg.fused_combine, pdl=cfg.pdl, lazy_rescale=cfg.lazy_rescale, tma=cfg.tma)


def build(op: Attention, device: Device, cfg: AttnConfig) -> Callable[..., None]:
    """The kernel for ``op`` with an explicit configuration (benchmarks and tuning sweep with this)."""
    inner = build_at(op, device, cfg)
    n, shapes = own_lengths(op)

    def kernel(q, k, v, out, lse, aux=None) -> None:
        inner(n, shapes, q, k, v, out, lse, aux)

    kernel.__name__ = f"triton_attention_{op.content_hash()}"
    kernel.config = cfg
    kernel.workspace_bytes = plan.workspace_bytes(op, cfg)
    return kernel


def own_lengths(op: Attention) -> tuple:
    """``(Lengths, shapes)`` of ``op`` itself, as ``build_at``'s kernels take them."""
    R = op.total_q if op.kv_layout is KVLayout.VARLEN else op.batch * op.seqlen_q
    return Lengths(op.seqlen_q, op.seqlen_k, R), op.shapes()


def fixed_lengths(op: Attention, cfg: AttnConfig) -> bool:
    """Whether ``build_at``'s kernel for ``cfg`` serves only ``op``'s own lengths: the Gluon prefill kernel (its
    grid and descriptors follow Sq and Sk) and the Gluon decode kernel over dense K/V (its K/V descriptors span
    Sk). ``attn_fwd`` and the Gluon decode kernel over pages read every length from the call."""
    return cfg.wgmma or (cfg.decode_ws and op.kv_layout is not KVLayout.PAGED)


def build_at(op: Attention, device: Device, cfg: AttnConfig) -> Callable[..., None]:
    """``kernel(n, shapes, q, k, v, out, lse, aux)`` under ``cfg`` for a member of ``op``'s shape class at lengths
    ``n`` (``Lengths``; ``shapes``: its operands' shapes, ``runtime.lengths_of``): the grid, the rows and
    the lengths the kernel gets follow ``n`` on every call, so one built kernel (and Triton's one compile of each
    integer specialisation) serves every length (``fixed_lengths``: the Gluon kernels that cannot)."""
    from .. import kernels
    from ..expr_triton import load_mods

    interpret = kernels.interpreted()
    arch = plan.family(device)[0]
    check(op, cfg, arch)
    if cfg.wgmma or cfg.decode_ws:
        return gluon_at(op, device, cfg, arch)
    fwd = kernels.load("attention_fwd").attn_fwd
    merge = kernels.load("attention_combine").attn_combine
    consts = constexprs(op, cfg, interpret, load_mods(op.score_mod, op.mask_mod, interpret))
    # calls whose tensors break TMA's rules (tma_blocker) run this pointer kernel, compiled on first use
    ptr_consts = dict(consts, TMA=False)
    varlen = op.kv_layout is KVLayout.VARLEN
    rows = cfg.block_m // cfg.pack
    launch_opts = {} if interpret else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl,
                                            **KERNEL_OPTIONS)
    # (device, R, query tiles) -> StreamWorkspace: a decode loop keeps one; a new Sq (prefill) sizes another
    workspace = LRU(WORKSPACE_SETS)
    cconsts = combine.constexprs(op, cfg, consts["BLOCK_DV"])
    combine_opts = {} if interpret else dict(num_warps=4, launch_pdl=cconsts["PDL"], **KERNEL_OPTIONS)
    # key: the pointer fallback; every integer argument (strides, lengths) is guarded by its specialisation only
    fwd_launch = {False: KernelLaunch(fwd, (1, 1), consts, launch_opts, interpret, free_ints=True)}
    combine_launch = KernelLaunch(merge, (1,), cconsts, combine_opts, interpret, free_ints=True)

    passed: list[tuple] = [()]   # the dtypes, inner strides and index arrays of the last call that passed the checks

    B, Hq, scale = op.batch, op.heads_q, op.scale

    def kernel(n, shapes, q, k, v, out, lse, aux=None) -> None:
        aux = unit_stride_aux(aux or {})
        bt, sk, cu_q, cu_k = (aux.get(a) for a in AUX_NAMES)
        # what the checks read but the shapes (compared directly: a new length changes them, not the verdict)
        key = (q.dtype, k.dtype, v.dtype, out.dtype, q.stride(-1), k.stride(-1), v.stride(-1), out.stride(-1),
               None if lse is None else lse.dtype, bt is None, sk is None, cu_q is None, cu_k is None)
        if key != passed[0] or q.shape != shapes["q"] or k.shape != shapes["k"] or v.shape != shapes["v"] \
                or out.shape != shapes["out"] or (lse is not None and lse.shape != shapes.get("lse")):
            check_operands(op, shapes, q, k, v, out, lse)
            check_aux(op, bt, sk, cu_q, cu_k)
            passed[0] = key
        if varlen:
            sq_, sk_ = (0,) + q.stride()[:2], (0,) + k.stride()[:2]
            sv_, so_ = (0,) + v.stride()[:2], (0,) + out.stride()[:2]
            sl_ = (0,) + (lse.stride() if lse is not None else (0, 0))
            R = n.total_q
            grid = ((-(-R // rows) + B + 1) * cfg.num_splits, Hq // cfg.pack)
        else:
            sq_, sk_, sv_, so_ = q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3]
            sl_ = lse.stride() if lse is not None else (0, 0, 0)
            R = B * n.seqlen_q
            grid = (-(-n.seqlen_q // rows) * cfg.num_splits, B * Hq // cfg.pack)
        sbt = bt.stride() if bt is not None else (0, 0)
        if cfg.num_splits > 1:
            wkey = (q.device, R, grid)
            ws = workspace.get(wkey)
            if ws is None:
                dev = q.device
                ws = StreamWorkspace(lambda: _workspace(op, cfg, R, grid, dev), stream_index(dev))
                workspace.put(wkey, ws)
            ws_o, ws_lse, locks = ws.get()
        else:
            ws_o = ws_lse = locks = None
        kd = vd = None
        fallback = False
        if cfg.tma:
            why = tma_blocker(k, v)
            if why is None:
                kd, vd = descriptors(cfg, k, v, consts["BLOCK_D"], consts["BLOCK_DV"])
            else:
                fallback = True
                warnings.warn(f"portakern: triton attention with tma=True runs pointer loads for this call: "
                              f"{why} (same results, TMA's speed-up lost)", RuntimeWarning, stacklevel=3)
        launch = fwd_launch.get(fallback)
        if launch is None:
            launch = fwd_launch[fallback] = KernelLaunch(fwd, (1, 1), ptr_consts, launch_opts, interpret,
                                                         free_ints=True)
        launch.on(grid, q, k, v, out, lse, ws_o, ws_lse, locks, bt, sk, cu_q, cu_k, kd, vd, *sq_, *sk_, *sv_, *so_,
                  *sl_, *sbt, B, n.total_q if varlen else n.seqlen_q, n.seqlen_k, R, scale)
        if cfg.num_splits > 1 and not cfg.fused_combine:
            combine_launch.on((R * Hq,), ws_o, ws_lse, out, lse, *so_, *sl_, n.seqlen_q, R)

    kernel.launchers = lambda: [*fwd_launch.values(), combine_launch]   # introspection (tests, benchmarks)
    return kernel


def build_gluon(op: Attention, device: Device, cfg: AttnConfig, arch: str) -> Callable[..., None]:
    """``gluon_at``'s kernel at ``op``'s own lengths: ``kernel(q, k, v, out, lse, aux)``."""
    inner, (n, shapes) = gluon_at(op, device, cfg, arch), own_lengths(op)

    def kernel(q, k, v, out, lse, aux=None) -> None:
        inner(n, shapes, q, k, v, out, lse, aux)

    return kernel


def gluon_at(op: Attention, device: Device, cfg: AttnConfig, arch: str) -> Callable[..., None]:
    """A Gluon kernel behind ``attn_fwd``'s per-call checks: the prefill kernel (``cfg.wgmma``, ``wgmma.py``) or
    the split decode kernel (``cfg.decode_ws``, ``decode_ws.py``), as ``build_at``'s ``kernel(n, shapes, ...)``
    (serving ``op``'s own lengths only where ``fixed_lengths``). A call whose tensors the kernel's descriptors
    cannot take (the module's ``call_blocker``) runs the ``attn_fwd`` table configuration instead, built on the
    first such call, with a RuntimeWarning naming the reason (same results, slower)."""
    if cfg.wgmma:
        mod, what = wgmma, "the wgmma prefill kernel"
        launch = wgmma.launcher(op, cfg)
    else:
        mod, what = decode_ws, "the Gluon decode kernel"
        merge = replace(cfg, fused_combine=False)        # the kernel always merges in attn_combine
        launch = decode_ws.launcher(op, cfg, combine.constexprs(op, merge, next_pow2(op.head_dim_v)))
    slow: list[Callable[..., None]] = []
    passed: list[tuple] = [()]   # the layout key of the last call that passed every check

    def kernel(n, shapes, q, k, v, out, lse, aux=None) -> None:
        aux = unit_stride_aux(aux or {})
        key = layout_key(q, k, v, out, lse, aux)
        if key == passed[0]:   # what the checks read is as on a call that passed them
            launch(q, k, v, out, lse, aux)
            return
        check_operands(op, shapes, q, k, v, out, lse)
        check_aux(op, *(aux.get(a) for a in AUX_NAMES))
        why = mod.call_blocker(q, k, v, out)
        if why is None:
            passed[0] = key
            launch(q, k, v, out, lse, aux)
            return
        if not slow:
            slow.append(build_at(op, device, plan.choose(op, arch, plan.family(device)[1], wgmma=False)))
        warnings.warn(f"portakern: triton attention runs attn_fwd instead of {what} for this call: {why} "
                      f"(same results, slower)", RuntimeWarning, stacklevel=3)
        slow[0](n, shapes, q, k, v, out, lse, aux)

    return kernel


def _workspace(op: Attention, cfg: AttnConfig, R: int, grid: tuple, device):
    """Split-KV partials (see the module docstring for the size) and the per-tile arrival counters."""
    import torch

    return (*combine.split_partials(op, cfg, R, device),
            torch.zeros((grid[0] // cfg.num_splits) * grid[1], dtype=torch.int32, device=device))


def time_config(op: Attention, device: Device, cfg: AttnConfig) -> float:
    """Seconds per call of ``op`` under ``cfg`` on random inputs (autotuning)."""
    import torch
    from triton.testing import do_bench

    q, k, v, out, lse, aux = random_inputs(op, torch.device(str(device)))
    kern = build(op, device, cfg)
    return do_bench(lambda: kern(q, k, v, out, lse, aux), warmup=5, rep=20) * 1e-3


def random_inputs(op: Attention, device, seed: int = 0):
    """Random ``(q, k, v, out, lse, aux)`` torch operands for ``op`` (full lengths; shuffled pages)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, op.dtype.value)
    shapes = op.shapes()

    def rnd(shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)

    q, k, v = rnd(shapes["q"]), rnd(shapes["k"]), rnd(shapes["v"])
    out = torch.empty(shapes["out"], dtype=dt, device=device)
    lse = torch.empty(shapes["lse"], dtype=torch.float32, device=device) if op.return_lse else None
    aux = {"block_table": None, "seqlens_k": None, "cu_seqlens_q": None, "cu_seqlens_k": None}
    i32 = dict(dtype=torch.int32, device=device)
    if op.kv_layout is KVLayout.PAGED:
        perm = torch.randperm(op.num_pages, generator=g, device=device)[: op.batch * op.max_pages]
        perm = perm % op.num_pages if perm.numel() == op.batch * op.max_pages else \
            torch.randint(0, op.num_pages, (op.batch * op.max_pages,), generator=g, device=device)
        aux["block_table"] = perm.reshape(op.batch, op.max_pages).to(**i32)
        aux["seqlens_k"] = torch.full((op.batch,), op.seqlen_k, **i32)
    elif op.kv_layout is KVLayout.VARLEN:
        aux["cu_seqlens_q"] = torch.linspace(0, op.total_q, op.batch + 1).round().to(**i32)
        aux["cu_seqlens_k"] = torch.linspace(0, op.total_k, op.batch + 1).round().to(**i32)
    elif op.has_seqlens_k:
        aux["seqlens_k"] = torch.full((op.batch,), op.seqlen_k, **i32)
    return q, k, v, out, lse, aux
