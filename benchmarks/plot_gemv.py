"""Plot a quantized-GEMV benchmark (``benchmarks/gemv.py`` JSON) and optionally a decode step
(``benchmarks/decode_step.py`` JSON): fraction of the bandwidth floor per shape, portakern against
tinygemm (int4) and bf16 ``F.linear``, one panel per M, plus the decode step's panel.

    python benchmarks/plot_gemv.py benchmarks/results/gemv-h200.json \
        [--decode benchmarks/results/decode-step-h200.json] --out docs/gemv-h200.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gemv", help="benchmarks/results/gemv-*.json")
    ap.add_argument("--decode", help="benchmarks/results/decode-step-*.json")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(args.gemv))
    rows = [r for r in res["rows"] if r["bits"] == 4 and "pk_graph_us" in r]
    ms = sorted({r["M"] for r in rows})
    panels = len(ms) + (1 if args.decode else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2), squeeze=False)
    for ax, M in zip(axes[0], ms):
        sel = [r for r in rows if r["M"] == M]
        labels = [f"{r['N']}x{r['K']}" for r in sel]
        x = range(len(sel))
        series = [("portakern", "pk_graph_us", "tab:blue"), ("tinygemm", "tinygemm_graph_us", "tab:orange"),
                  ("bf16 F.linear (own floor)", "bf16_graph_us", "tab:gray")]
        for i, (name, key, color) in enumerate(series):
            if key == "bf16_graph_us":   # bf16 moves 4x the bytes: its own floor
                vals = [r["floor_us"] * (2 * r["K"] * r["N"] + 2 * r["M"] * (r["K"] + r["N"])) / r["bytes"] / r[key]
                        for r in sel]
            else:
                vals = [r["floor_us"] / r[key] if r.get(key) else 0 for r in sel]
            ax.bar([j + (i - 1) * 0.27 for j in x], vals, width=0.27, label=name, color=color)
        ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"int4 g128 GEMV, M={M} (CUDA graph)", fontsize=10)
        ax.set_ylabel("fraction of the bandwidth floor")
        ax.legend(fontsize=7)
    if args.decode:
        dec = json.load(open(args.decode))
        ax = axes[0][-1]
        names = ["int4_portakern", "int4_tinygemm", "bf16"]
        ctxs = list(dec["results"])
        for i, name in enumerate(names):
            vals = [dec["results"][c].get(name, {}).get("graph_frac_floor", 0) for c in ctxs]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(ctxs))], vals, width=0.27, label=name)
        ax.set_xticks(range(len(ctxs)), [f"ctx {c}" for c in ctxs])
        ax.set_ylim(0, 1)
        ax.set_title("Llama-3-8B-shaped decode step (graph)", fontsize=10)
        ax.legend(fontsize=7)
    gpu = res.get("env", {}).get("gpu", "")
    fig.suptitle(f"{gpu}, {res.get('date', '')}, copy {res.get('copy_TBps', 0):.2f} TB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
