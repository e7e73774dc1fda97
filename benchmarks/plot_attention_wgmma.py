"""Bar chart of a wgmma-probe bench JSON: attn_fwd, the Gluon kernel's tiles, cuDNN and flash in TFLOP/s.

    python benchmarks/plot_attention_wgmma.py benchmarks/results/attention-wgmma-pingpong-h200.json \
        docs/attention-prefill-wgmma-h200.png --tile BN128-st3

Needs matplotlib (not a dependency of the package); the JSON comes from
``benchmarks/experiments/attention_wgmma_probe.py --phase bench``.
"""

from __future__ import annotations

import argparse
import json


def tflops(shape, us: float) -> float:
    B, S, H, D, causal = shape
    return 4 * B * H * S * S * D / (2 if causal else 1) / (us * 1e-6) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("png")
    ap.add_argument("--tile", default="BN128-st3", help="the Gluon tile the table runs (a key of the rows' 'wgmma')")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(a.json))
    rows = res["rows"]
    series = {"attn_fwd (Triton)": lambda r: r["table_us"], f"Gluon wgmma ({a.tile})": lambda r: r["wgmma"][a.tile],
              "SDPA cuDNN": lambda r: r["cudnn_us"], "SDPA flash": lambda r: r["flash_us"]}
    labels = [f"D{r['shape'][3]} S{r['shape'][1] // 1024}k B{r['shape'][0]}{' causal' if r['shape'][4] else ''}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(series)
    for i, (name, us) in enumerate(series.items()):
        vals = [tflops(r["shape"], us(r)) for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=20, ha="right")
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title(f"Prefill on {res['gpu']}, {res['date']} (Triton {res['triton']}, same run)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(a.png)


if __name__ == "__main__":
    main()
