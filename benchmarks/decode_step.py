"""One decode step of a Llama-3-8B-shaped model (batch 1), captured in one CUDA graph.

32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, vocab 128256, random weights.
portakern's step: every linear (qkv, o, gate+up, down, lm_head) is int4 group-128 asymmetric through
the kernel ``torch.ops.portakern.quant_gemv`` picks for its shape (``torch_ops.gemv_kernel``: the triton table, or
the cuda backend where its measured table ranks it first; weights straight in the GEMV layout (``portakern.gemv_weight``), which both read;
the results name each linear's backend), attention is
``portakern.attention`` over a paged KV cache (page 64, shuffled block table; torch SDPA on a dense
cache when the triton backend cannot serve it, said in the output), the element-wise glue
(residual add + RMSNorm, RoPE with the KV-cache append, SiLU-mul) is torch, fused by
``torch.compile`` with Inductor's combo kernels, each launched as a programmatic dependent of the kernel
before it (``--glue compile-pdl``, the default where Inductor can: it then starts while that kernel
drains, and the GEMV after it starts loading weights while it runs; ``--glue compile-combo``: not
dependent launches; ``--glue compile``: no combo kernels either, RoPE of q and of k + the append are two
launches; ``--glue eager``: plain torch ops). Peers re-measured in the same run, plain
PyTorch as in ``shared/peers``: bf16 ``F.linear`` and tinygemm int4 (``_weight_int4pack_mm``), SDPA
on a dense cache, eager glue.

Floor = (weight bytes: codes + fp16 scale + fp16 zero per group; + K/V bytes read) / copy bandwidth.

    python benchmarks/decode_step.py [--ctx 2048 8192] [--glue compile-combo|compile-pdl|compile|compile-max|eager]
        [--compare-glue GLUE] [--compare-attention table release early early+o2 ...] [--compare-gemv-backend triton]
        [--l2-prefetch UNITS ...] [--compare-tiles] [--fused-silu] [--sweep-gemv LINEAR ...] [--sweep-attention]
        [--ab-gemv LINEAR:CONFIG ...] [--ab-attention CONFIG ...]
        [--captures N] [--breakdown] [--no-peers] [--no-eager] [--out DIR] [--tag TAG]

The steps are defined in ``benchmarks/step_models.py``, the same-process variants (``--compare-*``, ``--sweep-*``,
``--ab-*``, ``--fused-silu``, ``--l2-prefetch``) in ``benchmarks/step_variants.py``. The result is
``decode-step<TAG>-<card>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import default_out, result_path, write  # noqa: E402
from step_glue import DEFAULT_GLUE, GLUES  # noqa: E402
from step_models import PortakernStep, TorchStep  # noqa: E402
from step_timing import capture, kernel_profile, kernel_timeline, logits_diff, time_step  # noqa: E402
from step_variants import add_variant_arguments, variants_for  # noqa: E402
from timing import copy_bandwidth_TBps  # noqa: E402

from portakern.conformance.report import run_identity  # noqa: E402
from portakern.devices import torch_device  # noqa: E402


# -- logits of two glues ----------------------------------------------------------------------------

def same_logits(step, glue: str, other: str) -> dict:
    """Logits of ``step`` captured with each glue compiled in Inductor's deterministic mode (no configuration
    chosen by timing), one replay each: with the same kernels in a different launch order or kind the two
    must be equal bit for bit. (The timed glues may differ in the last bits: Inductor times reduction
    configurations on first use, and a different reduction order changes the rounding.)"""
    if not hasattr(torch._inductor.config, "deterministic"):
        return {"skipped": f"torch {torch.__version__}: no torch._inductor.config.deterministic"}
    outs = []
    for g in (glue, other):
        st = step.with_glue(g, deterministic=True)
        capture(st)
        outs.append(st.out["lm"].float().clone())
    return {"glues": [glue, other], **logits_diff(*outs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192], metavar="TOKENS",
                    help="context lengths of the paged KV cache, each a separate step (default 2048 8192)")
    ap.add_argument("--glue", choices=GLUES, default=DEFAULT_GLUE,
                    help="portakern's glue: torch.compile with Inductor's combo kernels (the kernels of one glue "
                         "function that Inductor cannot fuse launched as one: 10 instead of 11 kernels per layer), "
                         "the same with each glue kernel launched "
                         "as a programmatic dependent of the kernel before it (Inductor's triton.enable_pdl; the "
                         "default where this torch has it, else compile-combo), plain torch.compile, torch.compile "
                         "with Inductor's autotuning (mode max-autotune-no-cudagraphs), or plain torch ops; default "
                         f"here {DEFAULT_GLUE}")
    ap.add_argument("--compare-glue", choices=GLUES, metavar="GLUE",
                    help="also time portakern's step (the same weights, in the same process) with its glue run as "
                         "GLUE, and record the largest difference of the two steps' logits (same kernels: 0 expected)")
    add_variant_arguments(ap)
    ap.add_argument("--no-eager", action="store_true", help="time the steps in their CUDA graphs only")
    ap.add_argument("--captures", type=int, default=1, metavar="N",
                    help="capture each step's graph N times afresh and report the median of the captures' medians "
                         "(each capture's in graph_ms_per_capture): one process has shown two levels ~0.04 ms apart "
                         "for the same step captured at different times (step-capture-spread-h200.json)")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the plain-PyTorch peers (bf16 F.linear and tinygemm int4 steps, SDPA, eager glue)")
    ap.add_argument("--out", default=default_out(),
                    help="folder of the result JSON decode-step<TAG>-<card>.json (default $OUT or benchmarks/results)")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -attention)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time portakern's step's GEMVs, attention and glue each alone in its own graph, "
                         "profile per-kernel device time, and attribute one replay's span to its kernels "
                         "(exposed time: what each moved the finish line by, overlaps under PDL counted once)")
    ap.add_argument("--compare-tiles", action="store_true",
                    help="also time portakern's step with the per-word-row GEMV tile everywhere (the table "
                         "without GemvConfig.group_rows and without the stream-K kernel), as int4_portakern_word_rows")
    args = ap.parse_args()

    bw = copy_bandwidth_TBps()
    res = {"model": "Llama-3-8B shapes, random weights, batch 1", "date": datetime.date.today().isoformat(),
           "copy_TBps": bw, "glue": args.glue, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "results": {}}
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    for ctx in args.ctx:
        runs = {}
        att = "portakern-paged"
        try:
            step = PortakernStep(ctx, args.glue, "portakern")
            t0 = time.time()
            step()
            torch.cuda.synchronize()
            print(f"ctx {ctx}: first step (compiles) {time.time() - t0:.1f}s", flush=True)
        except Exception as e:
            print(f"ctx {ctx}: portakern paged attention unavailable ({type(e).__name__}: {str(e)[:200]}); "
                  "using torch SDPA on a dense cache", flush=True)
            att = "sdpa-dense"
            step = PortakernStep(ctx, args.glue, "sdpa")
        runs["int4_portakern"] = (step, att)
        pk_attention = att
        # the same step (weights, caches) changed one way: timed here, its logits compared
        variants = variants_for(step, args) if att == "portakern-paged" else {}
        runs.update({name: (st, att) for name, st in variants.items()})
        variants = set(variants)   # names only: each step is freed once timed
        if args.compare_tiles:
            runs["int4_portakern_word_rows"] = (PortakernStep(ctx, args.glue, att.split("-")[0],
                                                              group_rows=False), att)
        if not args.no_peers:
            runs["bf16"] = (TorchStep(ctx, "bf16"), "sdpa-dense")
            runs["int4_tinygemm"] = (TorchStep(ctx, "tinygemm"), "sdpa-dense")
        out = {}
        logits = None
        for name, (st, att) in runs.items():
            try:
                nbytes = st.bytes()
                floor_ms = nbytes / (bw * 1e12) * 1e3
                per_capture = [time_step(st, graph=True) for _ in range(args.captures)]
                graph = statistics.median(per_capture)
                out[name] = {"attention": att, "bytes_GB": nbytes / 1e9, "floor_ms": floor_ms, "graph_ms": graph,
                             "graph_frac_floor": floor_ms / graph}
                if hasattr(st, "gemv_backends"):
                    out[name]["gemv_backends"] = dict(st.gemv_backends)
                if args.captures > 1:
                    out[name]["graph_ms_per_capture"] = per_capture
                if not args.no_eager:
                    eager = time_step(st, graph=False, reps=5)
                    out[name].update(eager_ms=eager, eager_frac_floor=floor_ms / eager, graph_speedup=eager / graph)
                if name == "int4_portakern":
                    logits = st.out["lm"].float().clone()   # the last replay's; every replay computes the same
                elif name in variants and logits is not None:
                    out[name].update(logits_diff(logits, st.out["lm"].float()))
                    if name.startswith("int4_portakern_glue_"):
                        out[name]["deterministic_glues"] = same_logits(step, args.glue, args.compare_glue)
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"ctx {ctx} {name}: {json.dumps(out[name])}", flush=True)
            runs[name] = None
            del st
            torch.cuda.empty_cache()
        if args.breakdown and pk_attention == "portakern-paged":
            st = PortakernStep(ctx, args.glue, "portakern")
            parts = {}
            for part in ("gemv", "attention", "glue"):
                try:
                    parts[part + "_graph_ms"] = time_step(st.part(part), graph=True)
                except Exception as e:
                    parts[part + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            parts["kernels"] = kernel_profile(st)
            try:
                parts["timeline"] = kernel_timeline(st)
            except Exception as e:
                parts["timeline_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["int4_portakern"]["parts"] = parts
            print(f"ctx {ctx} parts: {json.dumps({k: v for k, v in parts.items() if k not in ('kernels', 'timeline')})}",
                  flush=True)
            for k in parts["kernels"][:20]:
                print(f"  {k['us_total']:9.1f} us  {k['calls']:5d} x {k['us_mean']:7.2f} us  {k['name'][:90]}")
            tl = parts.get("timeline")
            if tl:
                print(f"  one replay: span {tl['span_us']:.1f} us, idle {tl['idle_us']:.1f} us; exposed / duration:")
                for k in tl["kernels"][:20]:
                    print(f"  {k['us_exposed']:9.1f} / {k['us_duration']:9.1f} us  {k['calls']:5d}  {k['name'][:80]}")
            del st
            torch.cuda.empty_cache()
        res["results"][str(ctx)] = out
    res["identity"] = run_identity(torch_device("cuda", 0))
    write(res, result_path(args.out, "decode-step", args.tag))
    print(f"{'ctx':>5} {'step':16} {'GB':>6} {'floor':>6} {'graph':>7} {'frac':>5} {'eager':>7}")
    for ctx, out in res["results"].items():
        for name, r in out.items():
            if "error" in r:
                print(f"{ctx:>5} {name:16} ERROR {r['error'][:80]}")
            else:
                print(f"{ctx:>5} {name:16} {r['bytes_GB']:6.3f} {r['floor_ms']:6.3f} {r['graph_ms']:7.3f} "
                      f"{r['graph_frac_floor']:5.2f} {r.get('eager_ms', float('nan')):7.3f}")


if __name__ == "__main__":
    sys.exit(main())
