"""Attention on the cuda backend: CuTe DSL prefill forwards for Hopper (sm_90a, ``kernels/attn_fwd_sm90.py``) and
Blackwell (sm_100a, ``kernels/attn_fwd_sm100.py``).

What it serves (``supports``): dense BSHD q / k / v in float16 or bfloat16, ``head_dim == head_dim_v`` in 32, 64,
96, 128 or 256, any GQA ratio, any ``score_mod`` / ``mask_mod`` expression (lowered to CuTe DSL while the kernel is
traced: ``expr_cute.py``), with or without the LSE, on a GPU of compute capability 9.0 (sm_90a: wgmma and TMA).
Everything else is refused with the reason: float32, other head dims, paged and varlen KV and ``seqlens_k``, older
GPUs (no wgmma) and Blackwell GPUs.

Blackwell: the sm_100a kernel (tcgen05, tensor memory) is **compiled, not executed**: ``compile_for_target(op,
"sm_100a")`` lowers it without a GPU, and ``supports`` answers yes for the *described* sm_100a target that
compile-only asks about, but no for a real GPU of capability 10.x -- no Blackwell GPU has run it, and an unexecuted
kernel is never served. ``supports`` tells the two apart by the device's ``arch``: a described target
(``conformance``'s ``target_device``) carries the compile target itself ("sm_90a", "sm_100a"), a real GPU
(``portakern.devices``) its plain architecture ("sm_90", "sm_100").

One compiled kernel serves a specialisation -- (dtype, head dim, score_mod, mask_mod, LSE): its tensors have a
dynamic layout (``call_args``: ``from_dlpack`` views, D innermost), so B, Sq, Sk, Hq, Hkv and the strides are
run-time values. Compile-only builds those same arguments from small CPU tensors (``_host_args``) and lowers what a
launch runs; each specialisation is lowered once per process and every case of it reuses the lowering
(``_lowered``).

Status: the sm_90a kernel lowers on a CPU-only machine (the tests read wgmma, TMA and setmaxnreg in its PTX) and
passed the gpu-tier conformance cases it supports on an H100, slower than triton (``docs/design/attention-cute.md``);
the backend never ranks it above triton (``tuning.ATTENTION_TABLE`` is empty: no measured win), so ``backend=None``
is unchanged and only ``backend="cuda"`` on an sm_90 GPU reaches it. The sm_100a kernel is compiled, not executed.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Callable, NamedTuple

from portakern.backend import YES, Support, no
from portakern.errors import BackendError
from portakern.ir.dtypes import DType
from portakern.ir.expr import Expr
from portakern.ir.ops import Attention, KVLayout

from . import expr_cute
from .common import cute_dsl

#: head dims (= head_dim_v) the kernel is built for, and the keys of its key tile at each (128 query rows a tile;
#: D = 256 takes 64 keys so that S, P and the 64 x 256 O accumulator of a warpgroup fit its registers unspilled)
TILE_N = {32: 128, 64: 128, 96: 128, 128: 128, 256: 64}
HEAD_DIMS = tuple(TILE_N)
#: compute capability of the GPUs it runs on (Hopper: wgmma, TMA, setmaxnreg)
CAPABILITY = (9, 0)
#: compile-only targets -> the compute capability each is built for (the DSL's ``--gpu-arch`` is the target)
TARGETS = {"sm_90a": (9, 0), "sm_100a": (10, 0)}
#: the largest grid y (query heads) and z (batch) of a launch
MAX_GRID_YZ = 65535
_WAY_OUT = "use the triton backend (leave backend unset, or pass backend='triton')"


class Spec(NamedTuple):
    """One compiled specialisation: what the kernel fixes at compile time."""

    dtype: DType
    head_dim: int
    score_mod: Expr | None
    mask_mod: Expr | None
    return_lse: bool


def spec(op: Attention) -> Spec:
    """The specialisation that serves ``op`` (supported ops only)."""
    return Spec(op.dtype, op.head_dim, op.score_mod, op.mask_mod, op.return_lse)


def refusal(op: Attention) -> str | None:
    """Why the kernel cannot compute ``op`` on any GPU (None when it can): the IR features it serves."""
    where = f"attention({op.dtype.value}, head_dim={op.head_dim}, head_dim_v={op.head_dim_v}"
    if op.dtype not in (DType.float16, DType.bfloat16):
        return f"{where}) is not supported by cuda: its tensor-core kernels take float16 or bfloat16; {_WAY_OUT}"
    if op.head_dim != op.head_dim_v or op.head_dim not in HEAD_DIMS:
        return (f"{where}) is not supported by cuda: head_dim must equal head_dim_v and be one of "
                f"{', '.join(map(str, HEAD_DIMS))}; {_WAY_OUT} or pad the head dimension")
    if op.kv_layout is not KVLayout.DENSE or op.has_seqlens_k:
        layout = "seqlens_k" if op.kv_layout is KVLayout.DENSE else f"{op.kv_layout.value} KV"
        return f"attention with {layout} is not supported by cuda: its kernel reads dense BSHD k / v; {_WAY_OUT}"
    for name in ("score_mod", "mask_mod"):
        why = expr_cute.refusal(getattr(op, name))
        if why:
            return f"attention with {name} {getattr(op, name)} is not supported by cuda: {why}; {_WAY_OUT}"
    if op.heads_q > MAX_GRID_YZ or op.batch > MAX_GRID_YZ:
        return (f"attention(batch={op.batch}, heads_q={op.heads_q}) is not supported by cuda: its grid takes at "
                f"most {MAX_GRID_YZ} of each; {_WAY_OUT}")
    return None


def described_target(device) -> str | None:
    """The compile target ``device`` describes (``TARGETS``: "sm_90a", "sm_100a"), or None for a real GPU.

    Compile-only (``conformance --compile-only``) asks ``supports`` about a synthetic device whose ``arch`` is the
    target itself, arch-specific suffix included; a GPU found by ``portakern.devices`` has its plain architecture
    ("sm_100"), never a suffixed one. The answer for a described target is "can it be lowered for this target";
    for a real GPU "can it run here"."""
    arch = getattr(device, "arch", "")
    return arch if arch in TARGETS and tuple(device.capability or ()) == TARGETS[arch] else None


def supports(op: Attention, device) -> Support:
    """Dense float16 / bfloat16 attention, D = Dv in 32, 64, 96, 128 or 256, any expressions, with CuTe DSL
    importable, on a real sm_90 GPU (capability 9.0) or a described compile target of ``TARGETS`` (sm_90a, sm_100a:
    lowered, not run; ``described_target``); else no, with the reason. A real Blackwell GPU (capability 10.x) is
    refused: the sm_100a kernel is compiled but has not run on one, and an unexecuted kernel is never served."""
    why = cute_dsl.unavailable()
    if why:
        return no(f"attention on cuda needs {why}")
    cap = tuple(device.capability or ())
    target = described_target(device)
    if target is None and cap != CAPABILITY:
        arch = device.arch or f"capability {cap}"
        if cap and (10, 0) <= cap < (11, 0):
            return no(f"attention on cuda is not served on {arch}: the sm_100a kernel is compiled but has not run "
                      f"on a Blackwell GPU; {_WAY_OUT}")
        if cap and (11, 0) <= cap < (12, 0):
            return no(f"attention on cuda has no kernel for {arch}: the CuTe DSL kernels are built for sm_90a "
                      f"(run) and sm_100a (compiled, not run); {_WAY_OUT}")
        return no(f"attention on cuda needs a Hopper GPU (sm_90: wgmma and TMA); {device} is {arch}; {_WAY_OUT}")
    why = refusal(op)
    return no(why) if why else YES


# -- lowering --------------------------------------------------------------------------------------------------------

def _host_args(s: Spec, heads_q: int, heads_kv: int) -> tuple:
    """The launcher's arguments (``call_args``) built from small CPU torch tensors of the specialisation's dtype and
    head dim: the same dynamic-layout DSL tensors a GPU call passes, so compile-only lowers what a launch runs (every
    length is a run-time value of that layout, so the tensors' own lengths do not matter)."""
    import cuda.bindings.driver as cuda
    import torch

    dtype = torch.float16 if s.dtype is DType.float16 else torch.bfloat16
    q, out = (torch.zeros(1, 2, heads_q, s.head_dim, dtype=dtype) for _ in range(2))
    k, v = (torch.zeros(1, 2, heads_kv, s.head_dim, dtype=dtype) for _ in range(2))
    lse = torch.zeros(1, heads_q, 2) if s.return_lse else None
    return call_args(q, k, v, out, lse, 1.0, cuda.CUstream(0))


#: the sm_100a kernel's key tile when its default one spills (a thread holds a whole row of S: half the row, half
#: the registers for the expressions' temporaries)
SM100_NARROW_TILE_N = 64


def _build(s: Spec, args: tuple, arch: str):
    """``(Lowered, compiled, variant)`` of ``s`` for ``arch`` on ``args``, the variant a dict of what was chosen.
    sm_90a: with the intra-warpgroup overlap (``{"overlap": True}``), or -- when that lowering spills registers (a
    stack frame; expression-heavy specialisations at D >= 128) -- without. sm_100a: key tiles of ``TILE_N``
    (``{"tile_n": ...}``), or of ``SM100_NARROW_TILE_N`` when that lowering spills (a score_mod and mask_mod
    both expression-heavy)."""
    if arch == "sm_100a":
        tile_n = TILE_N[s.head_dim]
        low, compiled = cute_dsl.lower(_kernel_sm100(s, tile_n), args, arch)
        if low.frame_bytes and tile_n > SM100_NARROW_TILE_N:
            tile_n = SM100_NARROW_TILE_N
            low, compiled = cute_dsl.lower(_kernel_sm100(s, tile_n), args, arch)
        return low, compiled, {"tile_n": tile_n}
    low, compiled = cute_dsl.lower(_kernel(s, overlap=True), args, arch)
    if not low.frame_bytes:
        return low, compiled, {"overlap": True}
    low, compiled = cute_dsl.lower(_kernel(s, overlap=False), args, arch)
    return low, compiled, {"overlap": False}


@lru_cache(maxsize=64)
def _lowered(s: Spec, arch: str):
    """``(Lowered, compiled, variant)`` of specialisation ``s`` for ``arch``, lowered once per process."""
    return _build(s, _host_args(s, 2, 1), arch)


#: per target: the kernel module and the MMA instructions its PTX must hold (regular expression, name)
_MMA = {"sm_90a": ("attn_fwd_sm90", r"wgmma\.mma_async", "wgmma.mma_async"),
        "sm_100a": ("attn_fwd_sm100", r"tcgen05\.mma\.cta_group", "tcgen05.mma")}


def compile_for_target(op: Attention, target: str) -> dict:
    """Lower ``op`` for ``target`` ("sm_90a" or "sm_100a") through CuTe DSL, no GPU (the target is the DSL's
    per-compile ``--gpu-arch``): the kernel, the specialisation, whether the sm_90a kernel kept the intra-warpgroup
    overlap (``overlap``) or the sm_100a kernel's key tile (``tile_n``; ``_build``), its PTX and cubin, the registers and stack frame a thread, the MMA
    (``wgmma`` or ``tcgen05``) and TMA instruction counts and the compile seconds (0.0 when the specialisation was
    already lowered in this process). The sm_100a kernel is compiled here, never run (``supports``).

    Raises:
      NotImplementedError for another target or an op ``supports`` refuses;
      BackendError when the lowering spills registers to local memory (a stack frame) or lacks the MMA / TMA
      instructions the kernel is written with (and, for sm_100a, the tensor-memory allocation).
    """
    if target not in TARGETS:
        raise NotImplementedError(f"attention on cuda lowers for {', '.join(TARGETS)} only, not {target}: its "
                                  f"CuTe DSL kernels are Hopper's (wgmma) and Blackwell's sm_100a (tcgen05)")
    why = cute_dsl.unavailable() or refusal(op)
    if why:
        raise NotImplementedError(why)
    s = spec(op)
    hits = _lowered.cache_info().hits
    low, _, variant = _lowered(s, target)
    fresh = _lowered.cache_info().hits == hits
    kernel, pattern, name = _MMA[target]
    mma, tma = low.count(pattern), low.count(r"cp\.async\.bulk\.tensor")
    if low.frame_bytes:
        raise BackendError(f"attention {s} for {target}: the CuTe DSL kernel spills ({low.frame_bytes} bytes of "
                           f"stack frame a thread, {low.registers} registers); its tiles need fewer live registers")
    missing = target == "sm_100a" and not low.count(r"tcgen05\.alloc")
    if not mma or not tma or missing:
        raise BackendError(f"attention {s} for {target}: the lowered PTX has {mma} {name} and {tma} "
                           f"cp.async.bulk.tensor instructions{' and no tcgen05.alloc' if missing else ''}; the "
                           f"kernel is written with them")
    art = {"target": target, "kernel": kernel, "spec": s, **variant, "ptx": low.ptx, "cubin": low.cubin,
           "registers": low.registers, "frame_bytes": low.frame_bytes, "tma": tma,
           "compile_s": low.seconds if fresh else 0.0}
    art["wgmma" if target == "sm_90a" else "tcgen05"] = mma
    return art


def _kernel(s: Spec, overlap: bool = True):
    """The kernel object of specialisation ``s`` (``overlap``: FA3's intra-warpgroup overlap)."""
    import cutlass

    from .kernels.attn_fwd_sm90 import AttnFwdSm90

    dtype = cutlass.Float16 if s.dtype is DType.float16 else cutlass.BFloat16
    return AttnFwdSm90(dtype, s.head_dim, s.score_mod, s.mask_mod, s.return_lse, tile_n=TILE_N[s.head_dim],
                       overlap=overlap)


def _kernel_sm100(s: Spec, tile_n: int):
    """The sm_100a kernel object of specialisation ``s`` with key tiles of ``tile_n``."""
    import cutlass

    from .kernels.attn_fwd_sm100 import AttnFwdSm100

    dtype = cutlass.Float16 if s.dtype is DType.float16 else cutlass.BFloat16
    return AttnFwdSm100(dtype, s.head_dim, s.score_mod, s.mask_mod, s.return_lse, tile_n=tile_n)


_DEVICE_LOCK = threading.Lock()
#: Spec -> the compiled launcher for the GPU (a compile cache: one entry per specialisation a process runs)
_DEVICE_KERNELS: dict = {}


def _device_kernel(s: Spec, args: tuple):
    """The compiled launcher of ``s`` for the GPU, compiled (sm_90a) once, on the first call's ``args`` -- the same
    kind of DSL tensors every later call passes, so the signature matches by construction."""
    fn = _DEVICE_KERNELS.get(s)
    if fn is None:
        with _DEVICE_LOCK:
            fn = _DEVICE_KERNELS.get(s)
            if fn is None:
                fn = _DEVICE_KERNELS[s] = _build(s, args, "sm_90a")[1]
    return fn


def call_args(q, k, v, out, lse, scale: float, stream) -> tuple:
    """The launcher's arguments from torch tensors: ``from_dlpack`` views with a dynamic layout (D innermost; q / k /
    v copied when not contiguous), ``lse`` likewise or None, the scale as Float32, the CUstream ``stream``."""
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    tensors = [from_dlpack(t.contiguous().detach(), assumed_align=16).mark_layout_dynamic(leading_dim=3)
               for t in (q, k, v, out)]
    lse_t = from_dlpack(lse.detach(), assumed_align=4).mark_layout_dynamic(leading_dim=2) if lse is not None else None
    return (*tensors, lse_t, cutlass.Float32(scale), stream)


def compile(op: Attention, device) -> Callable[..., None]:
    """The launcher ``kernel(q, k, v, out, lse, aux)`` for ``op`` on an sm_90 ``device`` (the only kind ``supports``
    serves: the sm_100a kernel is compiled, not run, so no launcher is built for it).

    q / k / v / out are torch CUDA tensors in BSHD, lse (B, Hq, Sq) float32 or None; a non-contiguous operand is
    copied to a contiguous one first (and out copied back). The DSL tensors are ``from_dlpack`` views with a dynamic
    layout (D innermost), the scale a Float32, the stream torch's current one; the first call of a specialisation
    compiles it on those arguments (so never inside a CUDA-graph capture), later calls reuse it."""
    why = refusal(op)
    if why:
        raise NotImplementedError(why)
    s = spec(op)

    def run(q, k, v, out, lse, aux) -> None:
        import cuda.bindings.driver as cuda
        import torch

        dense = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        args = call_args(q, k, v, dense, lse, op.scale, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
        _device_kernel(s, args)(*args)
        if dense is not out:
            out.copy_(dense)

    return run


__all__ = ["CAPABILITY", "HEAD_DIMS", "TARGETS", "TILE_N", "Spec", "call_args", "compile",
           "compile_for_target", "described_target", "refusal", "spec", "supports"]
