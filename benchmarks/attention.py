"""Attention on an NVIDIA GPU: portakern's triton backend against torch SDPA (cuDNN, flash) and FA4.

Same process, same inputs, bf16. Times are medians of ``triton.testing.do_bench`` (it flushes the
L2 before every call) and, for decode, per call inside a CUDA graph of back-to-back calls cycling over
rotated input sets (more than 4x the L2; ``graph_ms``). Prefill reports TFLOP/s (flops = 4 B H S^2 D,
x0.5 causal) and the ratio to cuDNN; decode reports microseconds, the ratio to cuDNN and the fraction
of the floor (K+V bytes over the copy bandwidth measured in the same run).

    python benchmarks/attention.py [--check] [--sweep] [--bench] [--quick] [--out DIR]

``--check`` runs every feature once on the GPU against the cpu reference; ``--sweep`` times the
candidate configurations of ``backends/triton/attention/autotune.py`` on representative shapes (the winners
serve ``--bench`` in the same run and are printed for the sm_90 table); results go to
``DIR/attention<TAG>-<card>.json`` with its plot beside it. Kernels are compiled up front in a pool of processes
(``attention_compile.py``); the report and plot are ``attention_report.py``'s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from dataclasses import replace

import torch
import triton
from triton.testing import do_bench

from attention_check import run_check  # benchmarks/ is the script's folder
from attention_compile import precompile, warm_conformance
from attention_report import plot, row_line, summary
from harness import default_out, result_path, write
from timing import copy_bandwidth_TBps, warm_on_side_stream
from portakern.devices import torch_device
from portakern.backends.triton import tuning
from portakern.backends.triton.attention import autotune, forward as A, plan
from portakern.backends.triton.common.arch import PDL_ARCHS
from portakern.ir import Attention, DType, KVLayout
from portakern.ir import expr as E

PEERS = os.path.join(os.path.dirname(__file__), "..", "shared", "peers", "h200-2026-12-02.json")


# -- problems -----------------------------------------------------------------------------------------

def prefill(B, S, H, D, causal, Hkv=None):
    return Attention(batch=B, seqlen_q=S, seqlen_k=S, heads_q=H, heads_kv=Hkv or H, head_dim=D, head_dim_v=D,
                     dtype=DType.bfloat16, scale=1 / math.sqrt(D), mask_mod=E.causal_mask() if causal else None)


def decode(B, L, page=0, Hq=32, Hkv=8, D=128):
    kw = {}
    if page:
        kw = dict(kv_layout=KVLayout.PAGED, page_size=page, num_pages=B * L // page + 7, has_seqlens_k=True)
    return Attention(batch=B, seqlen_q=1, seqlen_k=L, heads_q=Hq, heads_kv=Hkv, head_dim=D, head_dim_v=D,
                     dtype=DType.bfloat16, scale=1 / math.sqrt(D), **kw)


#: head dims the prefill rows and sweeps cover (``--head-dims`` narrows it)
HEAD_DIMS = [64, 128, 256]
#: ``--prefill-only``: no decode or paged rows
PREFILL_ONLY = False
#: ``--decode-warps`` / ``--decode-splits`` / ``--decode-merges``: what the packed-decode sweep varies
DECODE_SWEEP = {"warps": (4,), "splits": (4, 8, 12, 16, 24, 32, 48, 64), "merges": "all",
                "tiles": ((64, 3), (64, 4), (128, 3), (128, 4))}


def prefill_shapes(quick):
    rows = []
    for D, H in ((d, h) for d, h in ((64, 32), (128, 32), (256, 16)) if d in HEAD_DIMS):
        for S, B in ((1024, 16), (4096, 4), (16384, 1)):
            if quick and S == 1024 and D != 128:
                continue
            for causal in (False, True):
                rows.append((B, S, H, D, causal))
    return rows


DECODE = [(1, 8192), (1, 32768), (1, 131072), (16, 8192), (64, 4096)]
PAGED = [(1, 32768, 16), (1, 32768, 64), (64, 4096, 16), (64, 4096, 64)]
#: the default rows' sweep skips shapes its neighbours cover; ``--decode-shapes`` sweeps every shape it names
SWEEP_ALL_DECODE = False


# -- configurations -----------------------------------------------------------------------------------

def table_config(op, dev):
    arch, sms = plan.family(dev)
    return plan.choose(op, arch, sms)


def _merges(c, base, splits):
    """``(fused_combine, pdl)`` pairs the decode sweep times for candidate ``c`` (from ``base``) at ``splits``."""
    if c.decode_ws:       # the Gluon decode kernel always merges in attn_combine; pdl: both launches dependents
        return ((False, False), (False, True))
    if splits == 1:
        return ((True, False),)
    if DECODE_SWEEP["merges"] == "table":
        return ((base.fused_combine, base.pdl),)
    # the fused merge lost on dense keys at every split count on the H200 and won on pages of 16
    # (attention-decode-sweep-h200.json): swept up to 16 splits, with and without pdl
    fused = ((True, False), (True, True)) if base.fused_combine or splits <= 16 else ()
    return ((False, False), (False, True)) + fused


def sweep_candidates(op, dev):
    base = table_config(op, dev)
    arch, sms = plan.family(dev)
    out = [base, replace(base, fused_combine=False)] if base.num_splits > 1 and not base.decode_ws else [base]
    if base.pack > 1:
        # where the table runs the Gluon decode kernel (it always merges in attn_combine), attn_fwd's tiles too
        bases = [base] + ([plan.choose(op, arch, sms, wgmma=False)] if base.decode_ws else [])
        for b0, (bn, st), w in itertools.product(bases, DECODE_SWEEP["tiles"], DECODE_SWEEP["warps"]):
            c = plan.fit(op, replace(b0, block_n=bn, num_stages=st, num_warps=w), arch)
            tiles = -(-op.seqlen_k // c.block_n)
            for splits in DECODE_SWEEP["splits"] if b0.num_splits > 1 else (1, 2):
                if splits > tiles:
                    continue
                for fused, pdl in _merges(c, b0, splits):
                    if pdl and arch not in PDL_ARCHS:
                        continue
                    cand = replace(c, num_splits=splits, fused_combine=fused, pdl=pdl)
                    if cand not in out:
                        out.append(cand)
        return out
    out += [c for c in autotune.wgmma_candidates(op, arch) if c not in out]   # the Gluon kernel's tiles
    base = plan.choose(op, arch, sms, wgmma=False)          # attn_fwd's tiles below
    if base not in out:
        out.append(base)
    big = op.head_dim > 128
    grid = ((128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 3), (64, 64, 4, 2)) if big else \
        ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 4), (128, 64, 8, 4), (64, 64, 4, 3),
         (64, 128, 4, 2))
    for bm, bn, w, st in grid:
        c = plan.fit(op, replace(base, block_m=bm, block_n=bn, num_warps=w, num_stages=st), arch)
        if c not in out:
            out.append(c)
    # the conditional rescale (AttnConfig.lazy_rescale) on attn_fwd's table tile and the next one
    out += [replace(c, lazy_rescale=True) for c in [c for c in out if not c.wgmma][:2]]
    # v4: TMA K/V loads on attn_fwd's table tile, both ways (checked against the table's output in run_sweep)
    flip = plan.fit(op, replace(base, tma=not base.tma), arch)
    out += [flip] if flip != base and flip not in out else []
    # 128-key tiles with a third stage: past fit's 8 KiB margin, inside the card's 227 KiB (D=128: 224 KiB)
    deep = replace(base, block_n=128, num_stages=3)
    if not big and plan.smem_bytes(op, 128, 128, 3) <= tuning.SMEM_LIMIT.get(arch, 0) and deep not in out:
        out.append(deep)
    return out


# -- timing -------------------------------------------------------------------------------------------

def copy_bandwidth():
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written: back-to-back eager
    copies, as ``benchmarks/gemv.py`` measures it (no flush between them, like the calls in a graph it is
    the floor of). Not in a graph: there the copy is a memcpy node run at 2.7 TB/s
    (``results/timing-method-h200.json``)."""
    return copy_bandwidth_TBps() * 1e12


def n_sets(bytes_per_set, l2):
    return max(1, min(8, math.ceil(4 * l2 / max(1, bytes_per_set))))


def bench_ms(fn):
    return do_bench(fn, warmup=20, rep=80, return_mode="median")


#: A timed graph cycles over the input sets until one replay lasts about this long (at most
#: GRAPH_MAX_CALLS calls), so what a replay costs once -- 10-16 us: the graph's launch and what do_bench's
#: flush leaves behind (dirty L2 lines, presumably) -- is under 1% of a call. A graph of one call per set (at most
#: 8) charged B=1 decode at 32k keys (2 sets) ~6.5 us of it per call; an empty kernel "took" 2.9 us in a graph of
#: 2 calls and 1.3 us in one of 8 (``results/timing-method-h200.json``).
GRAPH_REPLAY_MS = 4.0
GRAPH_MAX_CALLS = 512


def capture(fns, calls):
    """A CUDA graph of ``calls`` calls cycling over ``fns`` (warmed already)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    return g


def graph_ms(fns):
    """Per-call milliseconds in one CUDA graph of back-to-back calls cycling over ``fns`` (input sets),
    long enough that the replay's own costs vanish (``GRAPH_REPLAY_MS``)."""
    warm_on_side_stream(fns)
    k = len(fns)
    per_call = do_bench(capture(fns, k).replay, warmup=5, rep=20, return_mode="median") / k
    calls = k * max(1, min(GRAPH_MAX_CALLS // k, math.ceil(GRAPH_REPLAY_MS / max(per_call, 1e-6) / k)))
    g = capture(fns, calls)
    return do_bench(g.replay, warmup=10, rep=max(60.0, 10 * calls * per_call), return_mode="median") / calls


def ours(op, dev, cfg, sets):
    kern = A.build(op, dev, cfg)
    return [(lambda s=s: kern(*s)) for s in sets]


def sdpa_fns(op, sets, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    causal = op.mask_mod is not None
    fns = []
    for q, k, v, *_ in sets:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))   # BHSD, SDPA's layout
        gqa = op.heads_q != op.heads_kv

        def f(qt=qt, kt=kt, vt=vt):
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
        fns.append(f)
    return fns


def fa4_fns(op, sets):
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None
    causal = op.mask_mod is not None
    return [(lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=causal)) for q, k, v, *_ in sets]


def time_impl(fns, graph):
    if fns is None:
        return None
    try:
        fns[0]()
        torch.cuda.synchronize()
        ms = bench_ms(fns[0]) if not graph else graph_ms(fns)
        return ms * 1e3
    except Exception as e:
        return f"ERR {type(e).__name__}: {str(e)[:120]}"


# -- phases -------------------------------------------------------------------------------------------

def run_sweep(ops, dev, l2):
    best, rows = {}, []
    for key, op in ops.items():
        decode_like = key.startswith("decode")
        k_sets = n_sets(2 * op.batch * op.seqlen_k * op.heads_kv * op.head_dim * 2, l2) if decode_like else 1
        sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(k_sets)]
        res, ref = [], None
        for cfg in sweep_candidates(op, dev):
            t = time_impl(ours(op, dev, cfg, sets), graph=decode_like)
            if ref is None and isinstance(t, float):
                ref = sets[0][3].clone()     # the table configuration's output
            elif isinstance(t, float):
                # every candidate must reproduce the table configuration's output (bf16, other split orders)
                err = (sets[0][3].float() - ref.float()).abs().max().item()
                if not err <= 5e-2:
                    t = f"ERR output differs from the table configuration's by {err:.3g}"
            res.append((t, cfg))
            rows.append(dict(shape=key, config=cfg.to_json(), us=t))
        ok = [(t, c) for t, c in res if isinstance(t, float)]
        if ok:
            t, c = min(ok, key=lambda x: x[0])
            best[key] = c
            print(f"sweep {key:34s} best {t:9.1f} us  table {res[0][0] if isinstance(res[0][0], float) else res[0][0]} "
                  f"-> {c.to_json()}", flush=True)
        del sets
    return best, rows


def run_bench(dev, best, quick, l2, bw, decode_only=False):
    rows = []
    for B, S, H, D, causal in prefill_shapes(quick) if not decode_only else ():
        op = prefill(B, S, H, D, causal)
        cfg = best.get(f"prefill-d{D}-s{S}-c{int(causal)}") or best.get(f"prefill-d{D}-c{int(causal)}") \
            or table_config(op, dev)
        sets = [A.random_inputs(op, torch.device("cuda"))]
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        r = dict(kind="prefill", B=B, S=S, H=H, D=D, causal=causal, config=cfg.to_json())
        for name, fns in (("portakern", ours(op, dev, cfg, sets)), ("cudnn", sdpa_fns(op, sets, "cudnn")),
                          ("flash", sdpa_fns(op, sets, "flash")), ("fa4", fa4_fns(op, sets))):
            us = time_impl(fns, graph=False)
            r[f"{name}_us"] = us
            r[f"{name}_tflops"] = flops / (us * 1e-6) / 1e12 if isinstance(us, float) else None
        rows.append(r)
        print(row_line(r), flush=True)
        del sets
    for B, L, *page in DECODE + PAGED if not PREFILL_ONLY else ():
        page = page[0] if page else 0
        op = decode(B, L, page)
        key = f"decode-b{B}-l{L}-p{page}"
        cfg = best.get(key) or table_config(op, dev)
        kv_bytes = 2 * B * L * op.heads_kv * op.head_dim * 2
        k_sets = n_sets(kv_bytes, l2)
        sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(k_sets)]
        r = dict(kind="paged" if page else "decode", B=B, L=L, page=page, Hq=32, Hkv=8, D=128, config=cfg.to_json(),
                 floor_us=kv_bytes / bw * 1e6, sets=k_sets)
        impls = [("portakern", ours(op, dev, cfg, sets))]
        if not page:
            impls += [("cudnn", sdpa_fns(op, sets, "cudnn")), ("flash", sdpa_fns(op, sets, "flash"))]
        for name, fns in impls:
            r[f"{name}_us"] = time_impl(fns, graph=False)
            r[f"{name}_graph_us"] = time_impl(fns, graph=True)
        rows.append(r)
        print(row_line(r), flush=True)
        del sets
    return rows


def sweep_ops(quick, decode_only=False):
    ops = {}
    for D, H in ((d, h) for d, h in ((64, 32), (128, 32), (256, 16)) if d in HEAD_DIMS) if not decode_only else ():
        for causal in (False, True):
            ops[f"prefill-d{D}-c{int(causal)}"] = prefill(4, 4096, H, D, causal)
    for B, L, *page in DECODE + PAGED if not PREFILL_ONLY else ():
        page = page[0] if page else 0
        if not SWEEP_ALL_DECODE and (B == 16 or (page and B == 64)):  # covered by the neighbouring shapes
            continue
        ops[f"decode-b{B}-l{L}-p{page}"] = decode(B, L, page)
    return ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="every feature once on the GPU against the cpu reference")
    ap.add_argument("--sweep", action="store_true", help="time the tuning candidates on representative shapes")
    ap.add_argument("--bench", action="store_true", help="the tables against cuDNN / flash / FA4 (and the floor)")
    ap.add_argument("--quick", action="store_true", help="fewer prefill rows")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                    help="processes compiling the kernels up front")
    ap.add_argument("--out", default=default_out(),
                    help="folder of the result attention<TAG>-<card>.json and its plot (default $OUT or "
                         "benchmarks/results)")
    ap.add_argument("--check-on-cpu", action="store_true", help="only --check, under TRITON_INTERPRET=1")
    ap.add_argument("--warm-conformance", metavar="TIER", help="only compile every conformance case of TIER")
    ap.add_argument("--decode-only", action="store_true", help="--sweep and --bench: decode and paged shapes only")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -decode)")
    ap.add_argument("--head-dims", type=int, nargs="+", choices=(64, 128, 256), default=HEAD_DIMS,
                    help="--sweep and --bench: the prefill head dims to cover")
    ap.add_argument("--prefill-only", action="store_true", help="--sweep and --bench: no decode or paged shapes")
    ap.add_argument("--decode-shapes", nargs="+", metavar="B:L[:PAGE]",
                    help="--sweep and --bench: these decode shapes (batch, KV length, page size; no page = "
                         "dense) instead of the default rows, e.g. 1:2048:64 1:8192")
    for opt, what in (("warps", "num_warps values"), ("splits", "split counts")):
        ap.add_argument(f"--decode-{opt}", type=int, nargs="+", default=list(DECODE_SWEEP[opt]),
                        help=f"--sweep: {what} of the packed-decode candidates (default {DECODE_SWEEP[opt]})")
    ap.add_argument("--decode-tiles", nargs="+", metavar="BN:STAGES",
                    help="--sweep: key tiles and stages of the packed-decode candidates (default "
                         f"{' '.join(f'{bn}:{st}' for bn, st in DECODE_SWEEP['tiles'])})")
    ap.add_argument("--plot", metavar="RESULT_JSON",
                    help="only redraw the plot of a result file (writes RESULT.png beside it) and stop")
    ap.add_argument("--decode-merges", choices=("all", "table"), default="all",
                    help="--sweep: every merge variant of a split decode candidate, or the table's only")
    a = ap.parse_args()
    if a.plot:
        with open(a.plot) as f:
            print(f"wrote {plot(json.load(f), os.path.splitext(a.plot)[0] + '.png')}")
        return
    DECODE_SWEEP.update(warps=tuple(a.decode_warps), splits=tuple(a.decode_splits), merges=a.decode_merges)
    if a.decode_tiles:
        try:
            DECODE_SWEEP["tiles"] = tuple(tuple(int(v) for v in t.split(":")) for t in a.decode_tiles)
        except ValueError:
            ap.error(f"--decode-tiles {' '.join(a.decode_tiles)}: each tile is BN:STAGES in integers, e.g. 64:3")
        bad = [t for t in DECODE_SWEEP["tiles"] if len(t) != 2 or t[0] < 16 or t[0] & (t[0] - 1) or t[1] < 1]
        if bad:
            ap.error(f"--decode-tiles: {bad} -- BN must be a power of two >= 16 and STAGES >= 1")
    HEAD_DIMS[:] = a.head_dims
    global PREFILL_ONLY, SWEEP_ALL_DECODE
    PREFILL_ONLY = a.prefill_only
    if a.decode_shapes:
        try:
            shapes = [tuple(int(v) for v in t.split(":")) for t in a.decode_shapes]
        except ValueError:
            ap.error(f"--decode-shapes {' '.join(a.decode_shapes)}: each shape is B:L or B:L:PAGE in integers")
        if any(len(t) not in (2, 3) for t in shapes):
            ap.error(f"--decode-shapes {' '.join(a.decode_shapes)}: each shape is B:L or B:L:PAGE")
        DECODE[:] = [t for t in shapes if len(t) == 2]
        PAGED[:] = [t for t in shapes if len(t) == 3]
        SWEEP_ALL_DECODE = True
    if a.warm_conformance:
        warm_conformance(a.warm_conformance, a.workers)
        return
    if a.check_on_cpu:
        rows = run_check("cpu", 1)
        sys.exit(0 if all(r["ok"] for r in rows) else 1)
    dev = torch_device("cuda", 0)
    path = result_path(a.out, "attention", a.tag)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    res = {"date": datetime.date.today().isoformat(), "tag": a.tag, "device": dev.to_json(), "l2": l2,
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "cudnn": torch.backends.cudnn.version(), "commit": os.environ.get("PK_COMMIT", "")}}
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    print(f"device {dev.label}  copy {bw / 1e12:.3f} TB/s  triton {triton.__version__}  torch {torch.__version__}", flush=True)

    sw_ops = sweep_ops(a.quick, a.decode_only) if a.sweep else {}
    jobs = []
    for key, op in sw_ops.items():
        jobs += [(op.to_json(), c.to_json()) for c in sweep_candidates(op, dev)]
    if a.bench:
        for B, S, H, D, causal in prefill_shapes(a.quick) if not a.decode_only else ():
            op = prefill(B, S, H, D, causal)
            jobs.append((op.to_json(), table_config(op, dev).to_json()))
        for B, L, *page in DECODE + PAGED if not PREFILL_ONLY else ():
            op = decode(B, L, page[0] if page else 0)
            jobs.append((op.to_json(), table_config(op, dev).to_json()))
    if jobs:
        res["compile_errors"] = precompile(jobs, a.workers)
    if a.check:
        t = time.time()
        res["check"] = run_check("cuda", a.workers)
        print(f"checks took {time.time() - t:.1f}s", flush=True)
        write(res, path)
    best = {}
    if a.sweep:
        best, res["sweep"] = run_sweep(sw_ops, dev, l2)
        res["sweep_best"] = {k: c.to_json() for k, c in best.items()}
        write(res, path)
    if a.bench:
        if best:  # the sweep winners of 4k shapes also serve 1k / 16k rows: compile them first
            extra = []
            for B, S, H, D, causal in prefill_shapes(a.quick):
                c = best.get(f"prefill-d{D}-c{int(causal)}")
                if c:
                    extra.append((prefill(B, S, H, D, causal).to_json(), c.to_json()))
            precompile(extra, a.workers)
        res["bench"] = run_bench(dev, best, a.quick, l2, bw, a.decode_only)
    write(res, path)
    if res.get("bench"):
        try:
            print(f"wrote {plot(res, os.path.splitext(path)[0] + '.png')}")
        except Exception as e:  # matplotlib missing: the plot can be redrawn from the JSON
            print(f"no plot: {type(e).__name__}: {e}")
    summary(res)


if __name__ == "__main__":
    main()
