"""The GEMV benchmark's problems and portakern's kernels for them: the op, its byte floor, random weights in the
internal layout, input sets, what dispatch runs, and compiling every kernel of a run up front."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from dataclasses import asdict

import torch

from portakern.backends.triton import quant_gemv as Q
from portakern.backends.triton.quant_gemv.config import GemvConfig
from portakern.devices import torch_device
from portakern.gemv_weight import PreparedGemvWeight
from portakern.ir import DType, QuantFormat, gemv_layout
from portakern.ir.ops import QuantGemv


def gemv_op(M, N, K, bits=4, gs=128, sym=False, dtype=DType.bfloat16) -> QuantGemv:
    """The quant_gemv op of ``M`` rows, ``N`` x ``K`` codes of ``bits`` in groups of ``gs`` (asymmetric unless ``sym``)."""
    return QuantGemv(M=M, N=N, K=K, dtype=dtype, fmt=QuantFormat(bits=bits, group_size=gs, symmetric=sym))


def floor_bytes(op: QuantGemv) -> int:
    """Codes + fp16 scale (+ fp16 zero) per group + x + out (the peers' convention)."""
    G = op.K // op.fmt.group_size
    per_group = 2 + (0 if op.fmt.symmetric else 2)
    return (op.N * op.K * op.fmt.bits // 8 + op.N * G * per_group
            + op.M * op.K * op.dtype.itemsize + op.M * op.N * op.result_dtype.itemsize)


def random_prepared(N, K, bits, gs, sym, device="cuda", scale_dtype=torch.float16,
                    layout: str | None = "words+fragments") -> PreparedGemvWeight:
    """A random weight directly in the internal layout (timing only: random codes, no zeros), holding what
    ``layout`` holds (``portakern.gemv_weight.LAYOUTS``; None: the default a prepared weight gets). The sweeps time
    the word and the fragment kernels of one weight, so they keep both layouts."""
    from portakern.gemv_weight import check_layout

    layout = check_layout(layout)
    epw = 32 // bits
    kw = -(-K // epw)
    kwp = -(-kw // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    npad = -(-N // gemv_layout.N_ALIGN_WORDS) * gemv_layout.N_ALIGN_WORDS
    qw = torch.randint(-2**31, 2**31 - 1, (kwp, npad), dtype=torch.int32, device=device)
    qw[kw:] = 0
    G = K // gs
    s = (torch.rand(G, npad, device=device) * 0.01 + 0.001).to(scale_dtype)
    z = None if sym else torch.randint(0, 1 << bits, (G, npad), device=device).to(scale_dtype)
    frag = None   # the tensor-core fragment layout, where prepare_weight would build one (random words too)
    if gemv_layout.frag_eligible(bits, gs, False, False) is None:
        frag = torch.randint(-2**31, 2**31 - 1, (-(-K // gemv_layout.FRAG_CHUNK), npad // 16, 256), dtype=torch.int32,
                             device=device)
    if layout == "words":
        frag = None
    elif layout == "fragments" and frag is not None:
        qw = None
    return PreparedGemvWeight(qw, s, z, None, None, bits, gs, 1 << (bits - 1), N, K, frag=frag)


def ours(op: QuantGemv, cfg: GemvConfig | None, copies: int, kern=None, layout: str | None = "words+fragments"):
    """Input sets for the triton kernel of ``op`` under ``cfg`` (None: its table) -- or for ``kern``, any kernel of
    the GEMV layout (``portakern.gemv_weight``) -- and that kernel; the weights hold ``layout`` (``random_prepared``:
    None for the default layout, what a user's weights hold)."""
    dev = torch_device("cuda", 0)
    kern = Q.compile(op, dev, cfg) if kern is None else kern
    dt = getattr(torch, op.dtype.value)
    sets = []
    for _ in range(copies):
        w = random_prepared(op.N, op.K, op.fmt.bits, op.fmt.group_size, op.fmt.symmetric, layout=layout)
        x = torch.randn(op.M, op.K, device="cuda").to(dt)
        out = torch.empty(op.M, op.N, device="cuda", dtype=dt)
        sets.append((x, w, out))
    fns = [(lambda s=s: kern(*s)) for s in sets]
    return fns, kern


def dispatched(op: QuantGemv) -> tuple[str, object]:
    """``(backend, kernel)``: what ``portakern.quant_gemv`` / the torch op run for ``op`` on this GPU (the triton
    table, or the cuda backend where its measured table ranks it first; ``torch_ops.gemv_kernel``)."""
    from portakern import torch_ops

    return torch_ops.gemv_kernel(op, torch_device("cuda", 0))


def config_json(kern, fragments_only: bool = False) -> dict:
    """The launch configuration of a triton table kernel or a cuda backend kernel, as JSON: for a cuda kernel its
    word kernel's ``SmallMConfig``, or its fragment kernel's ``FragConfig`` when the weights hold only fragments."""
    frag = getattr(kern, "frag_config", None)   # the cuda backend's FragConfig (None: the op has no fragment kernel)
    if fragments_only and frag is not None:
        return {"kernel": "frag", **asdict(frag)}
    cfg = getattr(kern, "config", None)     # the cuda backend's SmallMConfig
    return asdict(cfg) if cfg is not None else next(iter(kern.launchers.values())).cfg.to_json()


def _warm(job):
    """Worker: compile one (op, config) by launching it once (fills Triton's cache); the error text or None."""
    try:
        op = QuantGemv.from_json(job["op"])
        fns, _ = ours(op, GemvConfig(**job["cfg"]) if job["cfg"] else None, 1)
        fns[0]()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, and the config is skipped in the sweep
        return f"{type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers):
    """Every distinct job compiled in ``workers`` spawned processes; ``{job JSON: error}`` of those that failed."""
    uniq = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    t = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    errors = {}
    with cf.ProcessPoolExecutor(max_workers=max(1, min(workers, len(uniq))), mp_context=ctx) as ex:
        for j, err in zip(uniq, ex.map(_warm, uniq)):
            if err:
                errors[json.dumps(j, sort_keys=True)] = err
    print(f"precompiled {len(uniq)} kernels in {time.time() - t:.1f}s ({len(errors)} failed)", flush=True)
    for k, e in list(errors.items())[:6]:
        print("   ", k[:160], "->", e, flush=True)
    return errors
