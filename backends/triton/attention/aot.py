"""Lowering the Triton attention kernels for a target without the device (``compile_for_target``).

The artifacts are what a launch on contiguous tensors of the op's shapes runs (``specialise.py``). Under Triton's
interpreter this process's Triton library is the interpreter's, so the lowering runs in a fresh process whose
environment says ``TRITON_INTERPRET=0`` (``_compile_in_subprocess``). The Gluon kernels lower through their own
modules (``wgmma.py``, ``decode_ws.py``).
"""

from __future__ import annotations

import os
from dataclasses import replace

from portakern.errors import UnsupportedError
from portakern.ir.ops import Attention, KVLayout

from .. import tuning
from ..common.arch import arch_family
from ..common.launch import KERNEL_OPTIONS
from . import combine, decode_ws, plan, wgmma
from .config import AttnConfig, next_pow2
from .forward import constexprs
from .rules import check
from .specialise import artifact, as_launched, launch_scalars

TARGETS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_90a": 90, "sm_100": 100, "sm_100a": 100,
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
    their fallback is ``plan.choose(..., wgmma=False)``.
    """
    try:
        cc = TARGETS[target]
    except KeyError:
        raise UnsupportedError(f"compile_for_target(target={target!r}): the triton backend lowers for "
                               f"{', '.join(sorted(TARGETS))}") from None
    from .. import kernels

    arch = arch_family(cc)
    if config is not None:
        check(op, config, arch)
    if kernels.interpreted():  # this process's triton library is the interpreter's: lower elsewhere
        return _compile_in_subprocess(op, target, config)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..expr_triton import load_mods

    cfg = config or plan.choose(op, arch, tuning.DEFAULT_SMS.get(arch, 132))
    if cfg.wgmma:
        return {"target": target, "config": cfg.to_json(), "kernels": wgmma.compile_for_target(op, cfg, cc)}
    elt = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[op.dtype.value]
    ptr = "*" + elt
    target_obj = GPUTarget("cuda", cc, 32)
    if cfg.decode_ws:
        arts = decode_ws.compile_for_target(op, cfg, cc)
        if cfg.num_splits > 1:
            merge = replace(cfg, fused_combine=False)       # the kernel always merges in attn_combine
            arts["attn_combine"] = _compile_combine(op, merge, next_pow2(op.head_dim_v), ptr, target_obj)
        return {"target": target, "config": cfg.to_json(), "kernels": arts}
    consts = constexprs(op, cfg, False, load_mods(op.score_mod, op.mask_mod, False))
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
    sig, fconsts, attrs = as_launched(fwd, sig, {**absent, **consts}, launch_scalars(op))
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl, **KERNEL_OPTIONS)
    result = {"target": target, "config": cfg.to_json(), "kernels": {}}
    ck = triton.compile(ASTSource(fwd, sig, fconsts, attrs), target=target_obj, options=options)
    result["kernels"]["attn_fwd"] = artifact(ck, getattr(ck.metadata, "num_warps", cfg.num_warps))
    if cfg.num_splits > 1 and not cfg.fused_combine:
        result["kernels"]["attn_combine"] = _compile_combine(op, cfg, consts["BLOCK_DV"], ptr, target_obj)
    return result


def _compile_combine(op: Attention, cfg: AttnConfig, block_dv: int, ptr: str, target_obj) -> dict:
    """``attn_combine``'s artifact for ``op`` split as ``cfg`` says, lowered for ``target_obj``."""
    import triton
    from triton.compiler import ASTSource

    from .. import kernels

    merge = kernels.load("attention_combine").attn_combine
    csig = {"WS_O": "*fp32", "WS_LSE": "*fp32", "O": ptr, "LSE": "*fp32" if op.return_lse else "constexpr"}
    cconst = combine.constexprs(op, cfg, block_dv)
    if not op.return_lse:
        cconst["LSE"] = None
    csig, cconst, cattrs = as_launched(merge, csig, cconst, launch_scalars(op))
    ck = triton.compile(ASTSource(merge, csig, cconst, cattrs), target=target_obj,
                        options={"num_warps": 4, "launch_pdl": cconst["PDL"], **KERNEL_OPTIONS})
    return artifact(ck, 4)


def _desc_signature(cfg: AttnConfig, elt: str, bd: int, bdv: int) -> dict[str, str]:
    """ASTSource types of ``K_DESC``/``V_DESC`` (the blocks of ``tma.descriptors``)."""
    if cfg.tma:
        return {"K_DESC": f"tensordesc<{elt}[1,{cfg.block_n},1,{bd}]>",
                "V_DESC": f"tensordesc<{elt}[1,{cfg.block_n},1,{bdv}]>"}
    return {"K_DESC": "constexpr", "V_DESC": "constexpr"}


def _compile_in_subprocess(op: Attention, target: str, config: AttnConfig | None) -> dict:
    """Run ``compile_for_target`` in a fresh interpreter whose environment (a copy of this one's) says
    ``TRITON_INTERPRET=0``."""
    import json
    import pickle
    import subprocess
    import sys
    import tempfile

    from portakern.errors import BackendError

    with tempfile.TemporaryDirectory(prefix="portakern-aot-") as tmp:
        path = os.path.join(tmp, "artifact.pickle")
        env = dict(os.environ, TRITON_INTERPRET="0")
        code = "from portakern.backends.triton.attention.aot import _aot_child; _aot_child()"
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
