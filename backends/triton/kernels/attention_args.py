"""What ``attn_fwd`` (``attention_fwd.py``) and ``attn_combine`` (``attention_combine.py``) take from a host.

Every backend that launches these kernel bodies (triton on NVIDIA, triton-rocm on AMD) builds their arguments and
checks a call's operands here, so a change to a kernel's signature or to what it reads is made once, beside the
kernel:

* ``fwd_constexprs`` / ``combine_constexprs``: the compile-time arguments, from the op and a launch configuration;
  the switches only some targets take (programmatic dependent launch, TMA, the fused merge, lazy rescaling, the
  fp32 ``tl.dot`` precision) are arguments, off unless a backend turns them on.
* ``refusal``: the kernel's own limits (head dims its tiles hold, the grid's second axis, varlen batch size, an
  expression Triton can spell), as the reason a backend's ``supports`` gives.
* ``AUX_NAMES``, ``unit_stride_aux``, ``check_operands``, ``check_aux``: the index arrays each KV layout reads
  and the per-call checks of what a compiled signature cannot see (shapes, dtypes, inner strides).
"""

from __future__ import annotations

from typing import Any, Callable

from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir.ops import Attention, KVLayout

#: Head dimensions (``head_dim``, ``head_dim_v``) the kernel's tiles hold.
MAX_HEAD_DIM = 256
#: Programs on the grid's second axis (batch x head groups; head groups for varlen): CUDA's bound, which HIP's
#: (65536 on CDNA) also admits.
MAX_GRID_Y = 65535
#: Varlen sequences per call (``BATCH_P2`` spans them).
MAX_VARLEN_BATCH = 1 << 14
#: ``attn_fwd``'s ``LAYOUT`` code of each KV layout.
LAYOUT = {KVLayout.DENSE: 0, KVLayout.PAGED: 1, KVLayout.VARLEN: 2}
#: The index arrays a call passes in ``aux``, in ``attn_fwd``'s argument order.
AUX_NAMES = ("block_table", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k")
#: the index arrays every kernel reads at unit stride (``SEQLENS_K + b``, ``CU_K + b``); the block table goes to
#: the kernels with its strides
UNIT_STRIDE_AUX = ("seqlens_k", "cu_seqlens_q", "cu_seqlens_k")


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


# -- compile-time arguments -------------------------------------------------------------------------------------

def fwd_constexprs(op: Attention, mods, interpret: bool, *, block_m: int, block_n: int, pack: int, num_splits: int,
                   dot_prec: str, fused_combine: bool = False, pdl: bool = False, lazy_rescale: bool = False,
                   tma: bool = False) -> dict[str, Any]:
    """The compile-time arguments of ``attn_fwd`` for ``op`` on a ``block_m`` x ``block_n`` tile (``pack`` query
    heads per tile, ``num_splits`` KV splits). ``mods``: the generated module of ``op``'s score_mod and mask_mod
    (``expr_mods.ExprModules.load``); ``interpret``: Triton's interpreter runs it (bf16 is upcast there);
    ``dot_prec``: ``tl.dot``'s input precision for fp32 operands ("ieee", "tf32"); the switches after it are the
    optional paths (the last split merges, programmatic dependent launch, conditional rescaling, TMA K/V loads)."""
    from .expr_mods import analyse_mask

    bounds = analyse_mask(op.mask_mod)
    bd = max(16, next_pow2(op.head_dim))
    bdv = max(16, next_pow2(op.head_dim_v))
    return dict(
        SCORE_MOD=mods.score_mod, MASK_MOD=mods.mask_mod,
        HQ=op.heads_q, GROUP=op.group_size, PACK=pack,
        D=op.head_dim, DV=op.head_dim_v, BLOCK_D=bd, BLOCK_DV=bdv,
        BLOCK_M=block_m, BLOCK_N=block_n,
        LAYOUT=LAYOUT[op.kv_layout], HAS_SEQLENS=op.has_seqlens_k, PAGE_SIZE=max(1, op.page_size),
        BATCH_P2=next_pow2(op.batch + 1) if op.kv_layout is KVLayout.VARLEN else 1,
        NUM_SPLITS=num_splits, FUSED_COMBINE=fused_combine,
        HAS_LEFT=bounds.left is not None, WIN_LEFT=bounds.left or 0,
        HAS_RIGHT=bounds.right is not None, WIN_RIGHT=bounds.right or 0,
        HAS_MASK=op.mask_mod is not None, MASK_ALL=bounds.residual, NEVER=bounds.never,
        HAS_SCORE_MOD=op.score_mod is not None, RETURN_LSE=op.return_lse,
        UPCAST=interpret and op.dtype.value == "bfloat16",
        DOT_PREC=dot_prec,
        PDL=pdl, LAZY_RESCALE=lazy_rescale, TMA=tma,
        RAW_MAX=op.score_mod is None and op.scale > 0 and not lazy_rescale,
    )


def combine_constexprs(op: Attention, num_splits: int, block_dv: int, *, pdl: bool = False, release: bool = False,
                       early: bool = False) -> dict[str, Any]:
    """The compile-time arguments of ``attn_combine`` merging ``num_splits`` partials of ``block_dv`` columns;
    ``pdl``, ``release``, ``early``: its programmatic-dependent-launch switches (NVIDIA sm_90+ only)."""
    return dict(HQ=op.heads_q, DV=op.head_dim_v, BLOCK_DV=block_dv, NUM_SPLITS=num_splits,
                SPLITS_P2=next_pow2(num_splits), VARLEN=op.kv_layout is KVLayout.VARLEN,
                RETURN_LSE=op.return_lse, PDL=pdl, RELEASE=release, EARLY=early)


# -- the kernel's limits ---------------------------------------------------------------------------------------

def refusal(op: Attention, device, backend: str, pack: Callable[[], int], grid_bound: str) -> str | None:
    """Why ``backend`` cannot run ``op`` on ``device`` with these kernels (None: it can), in the order a reader
    would fix them: head dims over ``MAX_HEAD_DIM``, a CPU whose Triton is not the interpreter, too many varlen
    sequences, a grid's second axis past ``MAX_GRID_Y`` (``pack()``: query heads per tile of the backend's plan;
    ``grid_bound``: how the reason states the bound, e.g. "at most"), an expression Triton cannot spell."""
    from . import interpreted
    from .expr_mods import generate_source

    where = f"{backend} on {device.arch or device.type}"
    for field, value in (("head_dim", op.head_dim), ("head_dim_v", op.head_dim_v)):
        if value > MAX_HEAD_DIM:
            return (f"attention({field}={value}) is not supported by {where}: head dimensions up to "
                    f"{MAX_HEAD_DIM} fit the kernel's tiles; pass backend=\"cpu\" or split the head dimension")
    if device.type == "cpu" and not interpreted():
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
                "here; set TRITON_INTERPRET=1 before the first import of triton")
    p = pack()
    if op.kv_layout is KVLayout.VARLEN:
        if op.batch >= MAX_VARLEN_BATCH:
            return (f"varlen attention with batch={op.batch} is not supported by {where}: at most "
                    f"{MAX_VARLEN_BATCH - 1} sequences per call; split the batch")
        grid_y = op.heads_q // p
    else:
        grid_y = op.batch * op.heads_q // p
    if grid_y > MAX_GRID_Y:
        return (f"attention with batch x heads = {grid_y} programs on the grid's second axis is not "
                f"supported by {where} ({grid_bound} {MAX_GRID_Y}); split the batch")
    try:
        generate_source(op.score_mod, op.mask_mod, backend)
    except UnsupportedError as e:
        return f"{e}; pass backend=\"cpu\""
    return None


# -- per-call checks -------------------------------------------------------------------------------------------

def unit_stride_aux(aux: dict) -> dict:
    """``aux`` with its 1-D index arrays at unit stride, as the kernels read them: a strided view (a column of a
    larger table, ``lens[::2]``) is copied for this call (an allocation, only for such a view); contiguous arrays
    and None pass as they are."""
    for name in UNIT_STRIDE_AUX:
        a = aux.get(name)
        if a is not None and a.stride(0) != 1 and a.shape[0] > 1:
            aux = dict(aux, **{name: a.contiguous()})
    return aux


def check_operands(op: Attention, shapes: dict, q, k, v, out, lse, *, backend: str) -> None:
    """Raise ``InvalidInputError`` for an operand of another dtype or shape than the op's, or a last dimension
    that is not contiguous (``backend``: named in the message)."""
    want = str(op.dtype.value)
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if str(a.dtype).rpartition(".")[2] != want:
            raise InvalidInputError(f"{name} has dtype {a.dtype}, but this attention op was compiled for {want}; "
                                    f"pass {want} arrays or compile the op for {a.dtype}")
        if tuple(a.shape) != shapes[name]:
            raise InvalidInputError(f"{name} has shape {tuple(a.shape)}, expected {shapes[name]} for this "
                                    f"{op.kv_layout.value} attention op")
        if a.shape[-1] > 1 and a.stride(-1) != 1:
            raise InvalidInputError(f"{name} has stride {a.stride(-1)} in its last dimension: the {backend} "
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
