"""Lowering the Triton attention kernels for a target without the device (``compile_for_target``).

The artifacts are what a launch on contiguous tensors of the op's shapes runs: ``_as_launched`` applies Triton's
launch-time specialisation (16-byte aligned pointers, integers equal to 1 constant, divisible by 16 marked, past
32 bits i64) to the scalars ``_launch_scalars`` derives from the shapes. Under Triton's interpreter the lowering
runs in a fresh process (``_compile_in_subprocess``). The Gluon kernels lower through their own modules
(``attention_wgmma``, ``attention_decode_ws``), which take ``_launch_scalars`` / ``_as_launched`` from here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from portakern.errors import UnsupportedError
from portakern.ir.ops import Attention, KVLayout

from . import tuning
from .attention import _combine_constexprs, _constexprs
from .backend import KERNEL_OPTIONS, interpret_env
from .tuning import AttnConfig

_TARGETS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_90a": 90, "sm_100": 100, "sm_100a": 100,
            "sm_120": 120, "sm_120a": 120}


def compile_for_target(op: Attention, target: str, config: AttnConfig | None = None) -> dict:
    """Lower ``op`` for ``target`` ("sm_80", "sm_90a", "sm_100a", "sm_120") with Triton, no GPU needed,
    under ``config`` (default: the target's table configuration).

    Returns ``{"target", "config", "kernels": {name: {"cubin": bytes, "ptx": str, "shared": int,
    "num_warps": int}}}``; ``attn_combine`` is included when the configuration splits the keys
    without fusing the merge. ``num_warps`` is the launch's warp count. With ``config.tma`` the TMA
    kernel is lowered (the pointer fallback of calls with misaligned K/V is ``tma=False``); with
    ``config.wgmma`` the Gluon kernel ``attn_fwd_wgmma`` (12 warps), with ``config.decode_ws`` the Gluon
    kernel ``attn_decode_ws`` (8 warps: a warpgroup and a load warp padded to one) and ``attn_combine``;
    their fallback is ``tuning.choose(..., wgmma=False)``.
    """
    try:
        cc = _TARGETS[target]
    except KeyError:
        raise UnsupportedError(f"compile_for_target(target={target!r}): the triton backend lowers for "
                               f"{', '.join(sorted(_TARGETS))}") from None
    from . import kernels

    arch = tuning.arch_family(cc)
    if config is not None:
        tuning.check_pdl(config, arch)
        tuning.check_tma(op, config, arch)
        tuning.check_wgmma(op, config, arch)
        tuning.check_decode_ws(op, config, arch)
    if kernels.interpreted():  # this process's triton library is the interpreter's: lower elsewhere
        return _compile_in_subprocess(op, target, config)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .expr_triton import load_mods

    cfg = config or tuning.choose(op, arch, tuning.DEFAULT_SMS.get(arch, 132))
    if cfg.wgmma:
        from . import attention_wgmma

        return {"target": target, "config": cfg.to_json(), "kernels": attention_wgmma.compile_for_target(op, cfg, cc)}
    elt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[op.dtype.value]
    ptr = "*" + elt
    target_obj = GPUTarget("cuda", cc, 32)
    if cfg.decode_ws:
        from . import attention_decode_ws

        arts = attention_decode_ws.compile_for_target(op, cfg, cc)
        if cfg.num_splits > 1:
            merge = replace(cfg, fused_combine=False)       # the kernel always merges in attn_combine
            arts["attn_combine"] = _compile_combine(op, merge, tuning.next_pow2(op.head_dim_v), ptr, target_obj)
        return {"target": target, "config": cfg.to_json(), "kernels": arts}
    consts = _constexprs(op, cfg, False, load_mods(op.score_mod, op.mask_mod, False))
    fwd = kernels.load("attention_fwd").attn_fwd
    lay = op.kv_layout
    sig = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr,
           "LSE": "*fp32" if op.return_lse else "constexpr",
           "WS_O": "*fp32" if cfg.num_splits > 1 else "constexpr",
           "WS_LSE": "*fp32" if cfg.num_splits > 1 else "constexpr",
           "LOCKS": "*i32" if cfg.num_splits > 1 else "constexpr",
           "BLOCK_TABLE": "*i32" if lay is KVLayout.PAGED else "constexpr",
           "SEQLENS_K": "*i32" if op.has_seqlens_k else "constexpr",
           "CU_Q": "*i32" if lay is KVLayout.VARLEN else "constexpr",
           "CU_K": "*i32" if lay is KVLayout.VARLEN else "constexpr",
           **_desc_signature(cfg, elt, consts["BLOCK_D"], consts["BLOCK_DV"])}
    absent = {n: None for n, t in sig.items() if t == "constexpr"}
    scalars = _launch_scalars(op)
    sig, fconsts, attrs = _as_launched(fwd, sig, {**absent, **consts}, scalars)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl, **KERNEL_OPTIONS)
    result = {"target": target, "config": cfg.to_json(), "kernels": {}}
    with interpret_env(False):  # lowering never interprets
        ck = triton.compile(ASTSource(fwd, sig, fconsts, attrs), target=target_obj, options=options)
        result["kernels"]["attn_fwd"] = _artifact(ck, getattr(ck.metadata, "num_warps", cfg.num_warps))
    if cfg.num_splits > 1 and not cfg.fused_combine:
        result["kernels"]["attn_combine"] = _compile_combine(op, cfg, consts["BLOCK_DV"], ptr, target_obj)
    return result


def _compile_combine(op: Attention, cfg: AttnConfig, block_dv: int, ptr: str, target_obj) -> dict:
    """``attn_combine``'s artifact for ``op`` split as ``cfg`` says, lowered for ``target_obj``."""
    import triton
    from triton.compiler import ASTSource

    from . import kernels

    combine = kernels.load("attention_combine").attn_combine
    csig = {"WS_O": "*fp32", "WS_LSE": "*fp32", "O": ptr, "LSE": "*fp32" if op.return_lse else "constexpr"}
    cconst = _combine_constexprs(op, cfg, block_dv)
    if not op.return_lse:
        cconst["LSE"] = None
    csig, cconst, cattrs = _as_launched(combine, csig, cconst, _launch_scalars(op))
    with interpret_env(False):
        ck = triton.compile(ASTSource(combine, csig, cconst, cattrs), target=target_obj,
                            options={"num_warps": 4, "launch_pdl": cconst["PDL"], **KERNEL_OPTIONS})
    return _artifact(ck, 4)


def _launch_scalars(op: Attention) -> dict[str, int]:
    """The integer arguments ``build``'s launches pass for contiguous operands of ``op``'s shapes, by name
    (strides, lengths, rows), so that ``compile_for_target`` lowers what such a launch runs."""
    shapes = op.shapes()

    def strides(name: str, n: int) -> tuple[int, ...]:
        if name not in shapes:
            return (0,) * n
        out, acc = [], 1
        for d in reversed(shapes[name]):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))

    varlen = op.kv_layout is KVLayout.VARLEN
    if varlen:
        per = {t: (0,) + strides(t, 3)[:2] for t in ("q", "k", "v", "out")}
        per["lse"] = (0,) + strides("lse", 2)
    else:
        per = {t: strides(t, 4)[:3] for t in ("q", "k", "v", "out")}
        per["lse"] = strides("lse", 3)
    names = {"q": "stride_q", "k": "stride_k", "v": "stride_v", "out": "stride_o"}
    vals = {f"{names[t]}{x}": v for t in names for x, v in zip("bsh", per[t])}
    vals.update(zip(("stride_lb", "stride_lh", "stride_ls"), per["lse"]))
    vals.update(zip(("stride_btb", "stride_btp"), strides("block_table", 2)))
    rows = op.total_q if varlen else op.batch * op.seqlen_q
    vals.update(batch=op.batch, seqlen_q=op.total_q if varlen else op.seqlen_q, seqlen_k=op.seqlen_k,
                total_rows=rows)
    return vals


def _as_launched(fn, sig: dict[str, str], consts: dict[str, Any], scalars: dict[str, int]):
    """``(sig, consts, attrs)`` for ``ASTSource`` with Triton's launch-time specialisation applied: pointers
    16-byte aligned (as torch allocates), an integer equal to 1 a constant, one divisible by 16 marked so,
    one past 32 bits an i64; ``scale`` an fp32. Names already in ``sig`` or ``consts`` keep their entry."""
    sig, consts, attrs = dict(sig), dict(consts), {}
    for i, name in enumerate(fn.arg_names):
        if name in consts and name not in sig:
            sig[name] = "constexpr"
        elif name in sig:
            if sig[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            sig[name] = "fp32"
        else:
            v = scalars[name]
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
                continue
            sig[name] = "i64" if abs(v) >= 1 << 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _desc_signature(cfg: AttnConfig, elt: str, bd: int, bdv: int) -> dict[str, str]:
    """ASTSource types of ``K_DESC``/``V_DESC`` (the blocks of ``_descriptors``)."""
    if cfg.tma:
        return {"K_DESC": f"tensordesc<{elt}[1,{cfg.block_n},1,{bd}]>",
                "V_DESC": f"tensordesc<{elt}[1,{cfg.block_n},1,{bdv}]>"}
    return {"K_DESC": "constexpr", "V_DESC": "constexpr"}


def _artifact(ck, num_warps: int) -> dict:
    md = ck.metadata
    return {"cubin": ck.asm.get("cubin"), "ptx": ck.asm.get("ptx"),
            "shared": getattr(md, "shared", None), "num_warps": num_warps}


def _compile_in_subprocess(op: Attention, target: str, config: AttnConfig | None) -> dict:
    """Run ``compile_for_target`` in a fresh interpreter with ``TRITON_INTERPRET=0``."""
    import json
    import pickle
    import subprocess
    import sys
    import tempfile

    from portakern.errors import BackendError

    with tempfile.TemporaryDirectory(prefix="portakern-aot-") as tmp:
        path = os.path.join(tmp, "artifact.pickle")
        env = dict(os.environ, TRITON_INTERPRET="0")
        code = "from portakern.backends.triton.attention_aot import _aot_child; _aot_child()"
        request = json.dumps({"op": op.to_json(), "target": target, "config": config and config.to_json()})
        proc = subprocess.run([sys.executable, "-c", code, path], input=request,
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise BackendError(f"lowering attention for {target} in a subprocess failed: "
                               f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        with open(path, "rb") as f:
            return pickle.load(f)


def _aot_child() -> None:
    """Entry point of ``_compile_in_subprocess``: op, target and config as JSON on stdin, pickle to argv[1]."""
    import json
    import pickle
    import sys

    from portakern.ir.ops import op_from_json

    req = json.loads(sys.stdin.read())
    cfg = AttnConfig(**req["config"]) if req["config"] else None
    art = compile_for_target(op_from_json(req["op"]), req["target"], cfg)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(art, f)
