"""The Llama-3-8B-shaped decode step's model shapes and its element-wise glue in torch (``benchmarks/decode_step.py``):
residual add + RMSNorm, RoPE with the KV-cache append, SiLU-mul, and how ``--glue`` compiles them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

LAYERS, HID, MLP, HQ, HKV, D, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
PAGE = 64
BF16 = torch.bfloat16
#: how the glue runs (``--glue``); the last is plain torch
GLUES = ("compile-combo", "compile-pdl", "compile", "compile-max", "eager")
#: the default: programmatic dependent glue kernels where this torch's Inductor can make them (on an H200 the step
#: took 2.333 vs 2.436 ms at ctx 2048 and 2.518 vs 2.783 at 8192 with them, in separate processes)
DEFAULT_GLUE = "compile-pdl" if hasattr(torch._inductor.config.triton, "enable_pdl") else "compile-combo"


def add_rmsnorm(resid, delta, w, eps: float = 1e-5):
    """``resid += delta`` (fp32) and the RMS-normalised bf16 input of the next linear."""
    r = resid + delta.float()
    xn = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)).to(BF16) * w
    return r, xn


def rope(qkv, cos, sin):
    """Split qkv (1, 6144), rotate q and k (half-split RoPE); q (1,1,HQ,D), k and v (1,HKV,D)."""
    q = qkv[:, : HQ * D].view(1, HQ, D).float()
    k = qkv[:, HQ * D: (HQ + HKV) * D].view(1, HKV, D).float()
    v = qkv[:, (HQ + HKV) * D:].view(1, HKV, D)

    def rot(t):
        t1, t2 = t[..., : D // 2], t[..., D // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    return rot(q).to(BF16).view(1, 1, HQ, D), torch.stack([rot(k).to(BF16), v], dim=0)


def rope_append(qkv, cos, sin, kvf, slot):
    """``rope`` and the new token's k and v written into the flattened page pool ``kvf`` (2, slots,
    HKV, D) at ``slot``: one fused kernel under ``torch.compile`` instead of three launches."""
    q, kv_new = rope(qkv, cos, sin)
    kvf.index_copy_(1, slot, kv_new)
    return q


def silu_mul(gu):
    g, u = gu[:, :MLP], gu[:, MLP:]
    return (F.silu(g.float()) * u.float()).to(BF16)


def glue_functions(glue: str, deterministic: bool = False):
    """``(add_rmsnorm, rope, rope_append, silu_mul)`` as ``--glue`` runs them (``GLUES``). ``deterministic``:
    Inductor's mode that chooses no kernel configuration by timing where the choice changes the numerics
    (so two glues differ only in how they launch; ``compile-*`` only)."""
    fns = (add_rmsnorm, rope, rope_append, silu_mul)
    if glue == "eager":
        return fns
    opts = dict(fullgraph=True, dynamic=False)
    if glue == "compile-max":
        opts["mode"] = "max-autotune-no-cudagraphs"
    elif glue == "compile-combo":   # Inductor's combo kernels: a function's independent kernels, one launch
        opts["options"] = {"combo_kernels": True}
    elif glue == "compile-pdl":     # and each glue kernel launched as a programmatic dependent
        if not hasattr(torch._inductor.config.triton, "enable_pdl"):
            raise SystemExit(f"--glue compile-pdl needs torch._inductor.config.triton.enable_pdl, which torch "
                             f"{torch.__version__} lacks; use --glue compile-combo")
        opts["options"] = {"combo_kernels": True, "triton.enable_pdl": True}
    if deterministic:
        opts.setdefault("options", {})["deterministic"] = True
    return tuple(torch.compile(f, **opts) for f in fns)
