"""Host side of the Triton attention backend: supports, compile, launch (lowering for a target: ``attention_aot``).

One kernel (``kernels/attention_fwd.py``) serves prefill and decode over dense, paged and varlen
KV; ``kernels/attention_combine.py`` merges KV splits. ``score_mod`` / ``mask_mod`` are lowered to
Triton source by ``expr_triton`` and passed to the kernel as constexpr functions; library
causal/window terms of the mask are recognised so key tiles outside them are skipped.

On sm_90 the table runs dense bf16/fp16 prefill at head dims 64, 128 and 256 on a second kernel,
``kernels/attention_wgmma.py`` (Gluon: a TMA load warp and two consumer warpgroups with their own
schedule; host side ``attention_wgmma.py``, ``AttnConfig.wgmma``, table ``tuning.WGMMA_TABLE``), and
split paged decode on a third, ``kernels/attention_decode_ws.py`` (Gluon: a load warp that reads the
block table and copies K/V pages by TMA, one consumer warpgroup; host side ``attention_decode_ws.py``,
``AttnConfig.decode_ws``, table ``tuning.SPLIT_PAGED_WS``; its splits always merge in ``attn_combine``).

Split-KV (decode, when the query tiles alone do not fill the GPU): the keys of each query tile are
split ``num_splits`` ways; each split writes a float32 partial output and LSE, and either the
separate ``attn_combine`` kernel or the last split to finish (in the same launch) merges them
(``AttnConfig.fused_combine``; per architecture in ``tuning.FUSED_COMBINE``). The workspace is
allocated once per compiled signature, device and CUDA stream (``stream_workspace``: a capture takes an
existing set) and kept in the kernel's closure: ``4 * num_splits * R * Hq * (Dv + 1)`` bytes with
``R = B * Sq`` (``total_q`` for varlen), plus one int32 arrival counter per query tile for ``attn_fwd``
(``tuning.workspace_bytes``; ``num_splits <= tuning.MAX_SPLITS``).

TMA (``AttnConfig.tma``, dense prefill on sm_90+): K and V go to the kernel as host-side
``TensorDescriptor``s, 4-D over the (B, Sk, Hkv, D) tensors with their own strides, built per call
(small host objects; no device allocation). TMA needs each base 16-byte aligned, every
stride but the last a multiple of 16 bytes and the last stride 1. A call whose tensors break
those rules (e.g. fp16 K with an odd ``Hkv * D``, or a view at an unaligned offset) runs the
pointer kernel instead, compiled on its first such call, with a RuntimeWarning naming the reason
(``tma_blocker``); the results are the same, only the speed differs.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable

from portakern.backend import YES, Support, no
from portakern.devices import Device
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir.ops import Attention, KVLayout

from . import tuning
from .backend import KERNEL_OPTIONS
from .tuning import AttnConfig
from .launch import KernelLaunch
from portakern.stream_workspace import StreamWorkspace, stream_index

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535
MAX_VARLEN_BATCH = 1 << 14
_LAYOUT = {KVLayout.DENSE: 0, KVLayout.PAGED: 1, KVLayout.VARLEN: 2}


def _interpreted() -> bool:
    from .kernels import interpreted

    return interpreted()


# -- supports ---------------------------------------------------------------------------------------

def supports(op: Attention, device: Device) -> Support:
    """Whether the kernels can run ``op`` on ``device``; a reason naming the limit when not."""
    where = f"triton on {device.arch or device.type}"
    for field, value in (("head_dim", op.head_dim), ("head_dim_v", op.head_dim_v)):
        if value > MAX_HEAD_DIM:
            return no(f"attention({field}={value}) is not supported by {where}: head dimensions up to "
                      f"{MAX_HEAD_DIM} fit the kernel's tiles; pass backend=\"cpu\" or split the head dimension")
    if device.type == "cpu" and not _interpreted():
        return no("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                  "here; set TRITON_INTERPRET=1 before the first import of triton")
    cfg = _config(op, device)
    if op.kv_layout is KVLayout.VARLEN:
        if op.batch >= MAX_VARLEN_BATCH:
            return no(f"varlen attention with batch={op.batch} is not supported by {where}: at most "
                      f"{MAX_VARLEN_BATCH - 1} sequences per call; split the batch")
        grid_y = op.heads_q // cfg.pack
    else:
        grid_y = op.batch * op.heads_q // cfg.pack
    if grid_y > MAX_GRID_Y:
        return no(f"attention with batch x heads = {grid_y} programs on the grid's second axis is not "
                  f"supported by {where} (CUDA allows {MAX_GRID_Y}); split the batch")
    try:
        from .expr_triton import generate_source

        generate_source(op.score_mod, op.mask_mod)
    except UnsupportedError as e:
        return no(f"{e}; pass backend=\"cpu\"")
    return YES


# -- configuration ------------------------------------------------------------------------------------

def _device_arch(device: Device) -> tuple[str, int]:
    if device.type != "cuda":
        return "interp", tuning.DEFAULT_SMS["interp"]
    cc = device.capability[0] * 10 + device.capability[1] if device.capability else 90
    arch = tuning.arch_family(cc)
    sms = int(dict(device.info).get("multiprocessors", tuning.DEFAULT_SMS.get(arch, 132)))
    return arch, sms


def _config(op: Attention, device: Device) -> AttnConfig:
    arch, sms = _device_arch(device)
    return tuning.choose(op, arch, sms)


def _constexprs(op: Attention, cfg: AttnConfig, interpret: bool, mods) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd`` for ``op`` under ``cfg``."""
    from .expr_triton import analyse_mask

    bounds = analyse_mask(op.mask_mod)
    bd = max(16, tuning.next_pow2(op.head_dim))
    bdv = max(16, tuning.next_pow2(op.head_dim_v))
    return dict(
        SCORE_MOD=mods.score_mod, MASK_MOD=mods.mask_mod,
        HQ=op.heads_q, GROUP=op.group_size, PACK=cfg.pack,
        D=op.head_dim, DV=op.head_dim_v, BLOCK_D=bd, BLOCK_DV=bdv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        LAYOUT=_LAYOUT[op.kv_layout], HAS_SEQLENS=op.has_seqlens_k, PAGE_SIZE=max(1, op.page_size),
        BATCH_P2=tuning.next_pow2(op.batch + 1) if op.kv_layout is KVLayout.VARLEN else 1,
        NUM_SPLITS=cfg.num_splits, FUSED_COMBINE=cfg.fused_combine,
        HAS_LEFT=bounds.left is not None, WIN_LEFT=bounds.left or 0,
        HAS_RIGHT=bounds.right is not None, WIN_RIGHT=bounds.right or 0,
        HAS_MASK=op.mask_mod is not None, MASK_ALL=bounds.residual, NEVER=bounds.never,
        HAS_SCORE_MOD=op.score_mod is not None, RETURN_LSE=op.return_lse,
        UPCAST=interpret and op.dtype.value == "bfloat16",
        DOT_PREC="ieee" if op.dtype.value == "float32" else "tf32",
        PDL=cfg.pdl, LAZY_RESCALE=cfg.lazy_rescale, TMA=cfg.tma,
        RAW_MAX=op.score_mod is None and op.scale > 0 and not cfg.lazy_rescale,
    )


def _pdl(cfg: AttnConfig) -> bool:
    """Whether the merge runs as a programmatic dependent launch (only with a separate merge kernel;
    ``attn_fwd`` itself is launched so whenever ``cfg.pdl``; ``early_merge``: behind the Gluon decode kernel,
    which lets it launch at its start)."""
    return (cfg.pdl or cfg.early_merge) and cfg.num_splits > 1 and not cfg.fused_combine


def tma_blocker(k, v) -> str | None:
    """Why this call's K and V cannot go through TMA (None when they can; see the module docstring
    for the rules)."""
    for name, a in (("k", k), ("v", v)):
        why = _tma_rules(name, a, a.stride()[:-1])
        if why:
            return why
    return None


def _tma_rules(name: str, a, strides) -> str | None:
    """TMA's alignment rules for a descriptor over ``a`` with outer ``strides`` (elements)."""
    elt = a.element_size()
    if a.data_ptr() % 16:
        return f"{name} starts at address {a.data_ptr():#x}, not 16-byte aligned"
    if a.stride(-1) != 1:
        return f"{name}.stride(-1) = {a.stride(-1)}, TMA needs 1"
    for st in strides:
        if st <= 0 or (st * elt) % 16:
            return (f"{name} has a stride of {st} elements ({st * elt} bytes), TMA needs positive "
                    f"multiples of 16 bytes")
    return None


def _descriptors(cfg: AttnConfig, k, v, block_d: int, block_dv: int):
    """Host TMA descriptors ``(k, v)``, 4-D over the (B, Sk, Hkv, D) tensors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor(k, list(k.shape), list(k.stride()), [1, cfg.block_n, 1, block_d]),
            TensorDescriptor(v, list(v.shape), list(v.stride()), [1, cfg.block_n, 1, block_dv]))


def _combine_constexprs(op: Attention, cfg: AttnConfig, block_dv: int) -> dict[str, Any]:
    """The compile-time arguments of ``attn_combine`` (shared by launches and AOT lowering)."""
    return dict(HQ=op.heads_q, DV=op.head_dim_v, BLOCK_DV=block_dv, NUM_SPLITS=cfg.num_splits,
                SPLITS_P2=tuning.next_pow2(cfg.num_splits), VARLEN=op.kv_layout is KVLayout.VARLEN,
                RETURN_LSE=op.return_lse, PDL=_pdl(cfg), RELEASE=cfg.release_next,
                EARLY=cfg.early_merge)


# -- compile ------------------------------------------------------------------------------------------

def compile(op: Attention, device: Device) -> Callable[..., None]:
    """The kernel ``kernel(q, k, v, out, lse, aux)`` for ``op`` on ``device`` (table or tuned config)."""
    arch, sms = _device_arch(device)
    if tuning.autotune_enabled() and device.type == "cuda":
        cfg = tuning.tuned(op, device, arch, sms, lambda c: _time_config(op, device, c))
    else:
        cfg = tuning.choose(op, arch, sms)
    return build(op, device, cfg)


def build(op: Attention, device: Device, cfg: AttnConfig) -> Callable[..., None]:
    """The kernel for ``op`` with an explicit configuration (benchmarks and tuning sweep with this)."""
    from . import kernels
    from .expr_triton import load_mods

    interpret = kernels.interpreted()
    arch = _device_arch(device)[0]
    tuning.check_pdl(cfg, arch)
    tuning.check_tma(op, cfg, arch)
    tuning.check_wgmma(op, cfg, arch)
    tuning.check_decode_ws(op, cfg, arch)
    if cfg.wgmma or cfg.decode_ws:
        return _build_gluon(op, device, cfg, arch)
    fwd = kernels.load("attention_fwd").attn_fwd
    combine = kernels.load("attention_combine").attn_combine
    consts = _constexprs(op, cfg, interpret, load_mods(op.score_mod, op.mask_mod, interpret))
    # calls whose tensors break TMA's rules (tma_blocker) run this pointer kernel, compiled on first use
    ptr_consts = dict(consts, TMA=False)
    shapes = op.shapes()
    varlen = op.kv_layout is KVLayout.VARLEN
    rows = cfg.block_m // cfg.pack
    R = op.total_q if varlen else op.batch * op.seqlen_q
    if varlen:
        grid = ((-(-op.total_q // rows) + op.batch + 1) * cfg.num_splits, op.heads_q // cfg.pack)
    else:
        grid = (-(-op.seqlen_q // rows) * cfg.num_splits, op.batch * op.heads_q // cfg.pack)
    launch_opts = {} if interpret else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl,
                                            **KERNEL_OPTIONS)
    workspace: dict[Any, Any] = {}   # device -> StreamWorkspace
    cconsts = _combine_constexprs(op, cfg, consts["BLOCK_DV"])
    combine_opts = {} if interpret else dict(num_warps=4, launch_pdl=cconsts["PDL"], **KERNEL_OPTIONS)
    fwd_launch = {False: KernelLaunch(fwd, grid, consts, launch_opts, interpret)}   # key: the pointer fallback
    combine_launch = KernelLaunch(combine, (R * op.heads_q,), cconsts, combine_opts, interpret)

    passed: list[tuple] = [()]   # the layout key (``_layout_key``) of the last call that passed the checks

    def kernel(q, k, v, out, lse, aux=None) -> None:
        aux = unit_stride_aux(aux or {})
        bt, sk, cu_q, cu_k = (aux.get(n) for n in AUX_NAMES)
        key = _layout_key(q, k, v, out, lse, aux)
        if key != passed[0]:
            _check(op, shapes, q, k, v, out, lse)
            _require(op, bt, sk, cu_q, cu_k)
            passed[0] = key
        if varlen:
            sq_, sk_ = (0,) + q.stride()[:2], (0,) + k.stride()[:2]
            sv_, so_ = (0,) + v.stride()[:2], (0,) + out.stride()[:2]
            sl_ = (0,) + (lse.stride() if lse is not None else (0, 0))
        else:
            sq_, sk_, sv_, so_ = q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3]
            sl_ = lse.stride() if lse is not None else (0, 0, 0)
        sbt = bt.stride() if bt is not None else (0, 0)
        if cfg.num_splits > 1:
            ws = workspace.get(q.device)
            if ws is None:
                dev = q.device
                ws = workspace[dev] = StreamWorkspace(lambda: _workspace(op, cfg, R, grid, dev), stream_index(dev))
            ws_o, ws_lse, locks = ws.get()
        else:
            ws_o = ws_lse = locks = None
        kd = vd = None
        fallback = False
        if cfg.tma:
            why = tma_blocker(k, v)
            if why is None:
                kd, vd = _descriptors(cfg, k, v, consts["BLOCK_D"], consts["BLOCK_DV"])
            else:
                fallback = True
                warnings.warn(f"portakern: triton attention with tma=True runs pointer loads for this call: "
                              f"{why} (same results, TMA's speed-up lost)", RuntimeWarning, stacklevel=2)
        launch = fwd_launch.get(fallback)
        if launch is None:
            launch = fwd_launch[fallback] = KernelLaunch(fwd, grid, ptr_consts, launch_opts, interpret)
        launch(q, k, v, out, lse, ws_o, ws_lse, locks, bt, sk, cu_q, cu_k, kd, vd, *sq_, *sk_, *sv_, *so_, *sl_, *sbt,
               op.batch, op.total_q if varlen else op.seqlen_q, op.seqlen_k, R, op.scale)
        if cfg.num_splits > 1 and not cfg.fused_combine:
            combine_launch(ws_o, ws_lse, out, lse, *so_, *sl_, op.seqlen_q, R)

    kernel.__name__ = f"triton_attention_{op.content_hash()}"
    kernel.config = cfg
    kernel.workspace_bytes = tuning.workspace_bytes(op, cfg)
    return kernel


def _build_gluon(op: Attention, device: Device, cfg: AttnConfig, arch: str) -> Callable[..., None]:
    """A Gluon kernel behind ``attn_fwd``'s per-call checks: the prefill kernel (``cfg.wgmma``,
    ``attention_wgmma``) or the split decode kernel (``cfg.decode_ws``, ``attention_decode_ws``). A call whose
    tensors the kernel's descriptors cannot take (the module's ``call_blocker``) runs the ``attn_fwd`` table
    configuration instead, built on the first such call, with a RuntimeWarning naming the reason (same
    results, slower)."""
    from . import attention_decode_ws, attention_wgmma

    shapes = op.shapes()
    if cfg.wgmma:
        mod, what = attention_wgmma, "the wgmma prefill kernel"
        launch = attention_wgmma.launcher(op, cfg)
    else:
        mod, what = attention_decode_ws, "the Gluon decode kernel"
        merge = replace(cfg, fused_combine=False)        # the kernel always merges in attn_combine
        launch = attention_decode_ws.launcher(op, cfg, _combine_constexprs(op, merge, tuning.next_pow2(op.head_dim_v)))
    slow: list[Callable[..., None]] = []
    passed: list[tuple] = [()]   # the layout key of the last call that passed every check

    def kernel(q, k, v, out, lse, aux=None) -> None:
        aux = unit_stride_aux(aux or {})
        key = _layout_key(q, k, v, out, lse, aux)
        if key == passed[0]:   # what the checks read is as on a call that passed them
            launch(q, k, v, out, lse, aux)
            return
        _check(op, shapes, q, k, v, out, lse)
        _require(op, *(aux.get(n) for n in AUX_NAMES))
        why = mod.call_blocker(q, k, v, out)
        if why is None:
            passed[0] = key
            launch(q, k, v, out, lse, aux)
            return
        if not slow:
            slow.append(build(op, device, tuning.choose(op, arch, _device_arch(device)[1], wgmma=False)))
        warnings.warn(f"portakern: triton attention runs attn_fwd instead of {what} for this call: {why} "
                      f"(same results, slower)", RuntimeWarning, stacklevel=2)
        slow[0](q, k, v, out, lse, aux)

    kernel.__name__ = f"triton_attention_{op.content_hash()}"
    kernel.config = cfg
    kernel.workspace_bytes = tuning.workspace_bytes(op, cfg)
    return kernel


def split_partials(op: Attention, cfg: AttnConfig, R: int, device):
    """The float32 partial outputs ``(num_splits, R, Hq, Dv)`` and log-sum-exps ``(num_splits, R, Hq)`` that
    ``attn_combine`` merges (``attn_fwd``'s and the Gluon decode kernel's workspace)."""
    import torch

    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty((cfg.num_splits, R, op.heads_q, op.head_dim_v), **f32),
            torch.empty((cfg.num_splits, R, op.heads_q), **f32))


def _workspace(op: Attention, cfg: AttnConfig, R: int, grid: tuple, device):
    """Split-KV partials (see the module docstring for the size) and the per-tile arrival counters."""
    import torch

    return (*split_partials(op, cfg, R, device),
            torch.zeros((grid[0] // cfg.num_splits) * grid[1], dtype=torch.int32, device=device))


AUX_NAMES = ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
#: the index arrays every kernel reads at unit stride (``SEQLENS_K + b``, ``CU_K + b``); the block table goes to
#: the kernels with its strides
UNIT_STRIDE_AUX = ("seqlens_k", "cu_seqlens_q", "cu_seqlens_k")


def unit_stride_aux(aux: dict) -> dict:
    """``aux`` with its 1-D index arrays at unit stride, as the kernels read them: a strided view (a column of a
    larger table, ``lens[::2]``) is copied for this call (an allocation, only for such a view); contiguous arrays
    and None pass as they are."""
    for name in UNIT_STRIDE_AUX:
        a = aux.get(name)
        if a is not None and a.stride(0) != 1 and a.shape[0] > 1:
            aux = dict(aux, **{name: a.contiguous()})
    return aux


def _layout_key(q, k, v, out, lse, aux: dict) -> tuple:
    """Everything ``_check``, ``_require`` and a Gluon kernel's ``call_blocker`` read from a call: the shapes and
    strides and dtypes of q, k, v, out (and lse), where each of the four starts against a 16-byte boundary (one value per
    tensor: the Gluon kernels' ``call_blocker`` requires q, k and v aligned but not ``out``), which index arrays
    are given. Equal keys get equal verdicts, so a call whose key matches one that passed skips them (they cost
    ~10-20 us of host time a call; the element size is the op's)."""
    return (q.shape, k.shape, v.shape, out.shape, q.stride(), k.stride(), v.stride(), out.stride(),
            q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, out.data_ptr() & 15,
            q.dtype, k.dtype, v.dtype, out.dtype,
            None if lse is None else (lse.shape, lse.dtype), tuple(aux.get(n) is None for n in AUX_NAMES))


def _check(op: Attention, shapes: dict, q, k, v, out, lse) -> None:
    """Cheap per-call checks of what the signature cache cannot see (shapes, dtypes, inner strides)."""
    want = str(op.dtype.value)
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if str(a.dtype).rpartition(".")[2] != want:
            raise InvalidInputError(f"{name} has dtype {a.dtype}, but this attention op was compiled for {want}; "
                                    f"pass {want} arrays or compile the op for {a.dtype}")
        if tuple(a.shape) != shapes[name]:
            raise InvalidInputError(f"{name} has shape {tuple(a.shape)}, expected {shapes[name]} for this "
                                    f"{op.kv_layout.value} attention op")
        if a.shape[-1] > 1 and a.stride(-1) != 1:
            raise InvalidInputError(f"{name} has stride {a.stride(-1)} in its last dimension: the triton "
                                    f"backend needs it contiguous; pass {name}.contiguous()")
    if op.return_lse and (lse is None or tuple(lse.shape) != shapes["lse"] or str(lse.dtype).rpartition(".")[2] != "float32"):
        raise InvalidInputError(f"lse must be a float32 array of shape {shapes['lse']} when return_lse=True")


def _require(op: Attention, bt, sk, cu_q, cu_k) -> None:
    lay = op.kv_layout
    need = {"block_table": lay is KVLayout.PAGED, "seqlens_k": op.has_seqlens_k,
            "cu_seqlens_q": lay is KVLayout.VARLEN, "cu_seqlens_k": lay is KVLayout.VARLEN}
    for name, a in (("block_table", bt), ("seqlens_k", sk), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if need[name] and a is None:
            raise InvalidInputError(f"aux[{name!r}] is missing: this {lay.value} attention op needs it")
        if not need[name] and a is not None:
            raise InvalidInputError(f"aux[{name!r}] was given but this {lay.value} attention op does not read it")


def _time_config(op: Attention, device: Device, cfg: AttnConfig) -> float:
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


# -- compile for a target without the device: attention_aot.py (the backend asks this module, like quant_gemv) --

def compile_for_target(op: Attention, target: str, config=None) -> dict:
    """``attention_aot.compile_for_target`` (imported on use: that module imports this one's helpers, so
    importing either first works)."""
    from . import attention_aot

    return attention_aot.compile_for_target(op, target, config)
