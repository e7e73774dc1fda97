"""Plot the M=1 stream-K GEMV benchmark (``experiments/gemv_stream_probe.py --phase bench`` JSON) and a decode
step (``decode_step.py`` JSON): fraction of the bandwidth floor per shape for the CUDA-core table kernel
("fma"), the stream-K kernel in one configuration and tinygemm, and the decode step's panel.

    python benchmarks/plot_gemv_stream.py PROBE.json --config 256x1x2 [--decode STEP.json] --out docs/X.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", help="benchmarks/results/gemv-stream-probe-*.json")
    ap.add_argument("--config", default="256x1x2", help="the stream configuration to plot (block_n x ahead x per_sm)")
    ap.add_argument("--decode", help="benchmarks/results/decode-step-*.json")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(args.probe))
    rows = [r for r in res["bench"] if isinstance(r["stream"].get(args.config), float)]
    if not rows:
        raise SystemExit(f"{args.probe} has no timed rows for --config {args.config}")
    panels = 2 if args.decode else 1
    fig, axes = plt.subplots(1, panels, figsize=(7.5 + 3.5 * (panels - 1), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2, 1][:panels]})
    ax = axes[0][0]
    series = [("fma (previous table)", lambda r: r["table_us"], "tab:gray"),
              (f"stream {args.config} (table from N=6144)", lambda r: r["stream"][args.config], "tab:blue"),
              ("tinygemm int4", lambda r: r["tinygemm_us"], "tab:orange")]
    for i, (name, get, color) in enumerate(series):
        vals = [r["floor_us"] / get(r) if isinstance(get(r), float) else 0.0 for r in rows]
        ax.bar([j + (i - 1) * 0.27 for j in range(len(rows))], vals, 0.27, label=name, color=color)
    ax.axhline(0.85, color="k", lw=0.8, ls="--", label="85% target")
    ax.set_xticks(range(len(rows)), [f"{r['N']}x{r['K']}" for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("fraction of the copy-bandwidth floor")
    ax.set_title(f"int4 g128 M=1, CUDA graph ({res['gpu']}, {res['date']})", fontsize=10)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="upper left")
    if args.decode:
        step = json.load(open(args.decode))
        ax = axes[0][1]
        ctxs = sorted(step["results"], key=int)
        names = [("int4_portakern", "portakern int4", "tab:blue"), ("int4_tinygemm", "tinygemm int4", "tab:orange"),
                 ("bf16", "bf16 (own floor)", "tab:gray")]
        for i, (key, label, color) in enumerate(names):
            vals = [step["results"][c][key]["graph_frac_floor"] if key in step["results"][c] else 0.0 for c in ctxs]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(ctxs))], vals, 0.27, label=label, color=color)
        ax.axhline(0.70, color="k", lw=0.8, ls="--", label="70% target")
        ax.set_xticks(range(len(ctxs)), [f"ctx {c}" for c in ctxs])
        ax.set_ylim(0, 1.05)
        ax.set_title("decode step, one CUDA graph", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
