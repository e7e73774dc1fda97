"""Plot a decode step benchmark (``decode_step.py`` JSON): per context, each step's time in its CUDA graph
with the fraction of the bandwidth floor it reaches, the floors marked.

    python benchmarks/plot_decode_step.py benchmarks/results/decode-step-h200.json --out docs/decode-step-h200.png
"""

from __future__ import annotations

import argparse
import json

#: legend labels of the step names ``decode_step.py`` writes (others are shown as written)
LABELS = {"int4_portakern": "portakern int4", "int4_tinygemm": "tinygemm int4 (PyTorch)", "bf16": "bf16 (PyTorch)",
          "int4_portakern_attention_hold": "portakern int4, attention merge not releasing the next GEMV",
          "int4_portakern_attention_release-pdl": "portakern int4, + decode kernel as a dependent",
          "int4_portakern_gemv_backend_triton": "portakern int4, every GEMV forced onto triton"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", help="benchmarks/results/decode-step-*.json")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(args.step))
    ctxs = list(res["results"])
    names = [n for n in res["results"][ctxs[0]] if "graph_ms" in res["results"][ctxs[0]][n]]
    if not names:
        raise SystemExit(f"{args.step} has no timed steps")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(ctxs))]
        rows = [res["results"][c].get(n, {}) for c in ctxs]
        ms = [r.get("graph_ms", 0.0) for r in rows]
        label = LABELS.get(n, n.replace("int4_portakern_glue_", "portakern int4, glue "))
        if n == "int4_portakern":
            label += f", glue {res.get('glue', '?')}"
        bars = ax.bar(xs, ms, width, label=label)
        for b, r in zip(bars, rows):
            if "graph_frac_floor" in r:
                ax.annotate(f"{r['graph_frac_floor']:.0%}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
    for c, ctx in enumerate(ctxs):   # the floor of each kind of weights: int4 and bf16
        for kind in ("int4_portakern", "bf16"):
            r = res["results"][ctx].get(kind)
            if r and "floor_ms" in r:
                ax.hlines(r["floor_ms"], c - 0.45, c + 0.45, colors="k", linestyles=":", linewidth=1)
    ax.set_xticks(range(len(ctxs)), [f"context {c}" for c in ctxs])
    ax.set_ylabel("ms per step (CUDA graph)")
    ax.set_title(f"Llama-3-8B-shaped decode step, batch 1, {res['gpu']} (dotted: int4 / bf16 floors; labels: "
                 "of floor)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
