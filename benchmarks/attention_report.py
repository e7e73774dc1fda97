"""``benchmarks/attention.py``'s report: one line per row while it runs, the summary at the end, and the plot
(prefill TFLOP/s against SDPA, decode as a fraction of the bandwidth floor)."""

from __future__ import annotations


def row_line(r):
    """One printed line of a bench row."""
    def f(x):
        return f"{x:8.1f}" if isinstance(x, float) else f"{str(x)[:8]:>8s}"
    if r["kind"] == "prefill":
        return (f"prefill D={r['D']:3d} S={r['S']:5d} B={r['B']:2d} c={int(r['causal'])}  TFLOP/s pk {f(r['portakern_tflops'])}"
                f" cudnn {f(r['cudnn_tflops'])} flash {f(r['flash_tflops'])} fa4 {f(r['fa4_tflops'])}")
    return (f"{r['kind']:7s} B={r['B']:2d} L={r['L']:6d} p={r['page']:3d} us pk {f(r['portakern_us'])} "
            f"graph {f(r['portakern_graph_us'])} cudnn {f(r.get('cudnn_us'))} flash {f(r.get('flash_us'))} "
            f"floor {f(r['floor_us'])}")


def plot(res, path):
    """Prefill TFLOP/s against SDPA and decode fraction of the bandwidth floor: a panel for each the run has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre = [r for r in res["bench"] if r["kind"] == "prefill"]
    dec = [r for r in res["bench"] if r["kind"] != "prefill"]
    if pre and dec:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [2, 1]})
    else:   # one panel: a --prefill-only or --decode-only run
        fig, a = plt.subplots(1, 1, figsize=(10 if pre else 7, 5))
        a1, a2 = (a, None) if pre else (None, a)
    if pre:
        x = range(len(pre))
        for i, (name, col) in enumerate((("portakern", "C0"), ("cudnn", "C1"), ("flash", "C2"))):
            a1.bar([j + (i - 1) * 0.27 for j in x], [r[f"{name}_tflops"] or 0 for r in pre], 0.27, label=name,
                   color=col)
        a1.set_xticks(list(x), [f"D{r['D']} S{r['S'] // 1024}k{' c' if r['causal'] else ''}" for r in pre],
                      rotation=60, fontsize=8)
        a1.set_ylabel("TFLOP/s (bf16)")
        a1.set_title("prefill: portakern triton vs torch SDPA")
        a1.legend()
    if dec:
        labels = [f"{r['kind'][0]} B{r['B']} {r['L'] // 1024}k{' p' + str(r['page']) if r['page'] else ''}"
                  for r in dec]
        frac = lambda r, k: r["floor_us"] / r[k] if isinstance(r.get(k), float) else 0  # noqa: E731
        xs = range(len(dec))
        a2.bar([j - 0.2 for j in xs], [frac(r, "portakern_graph_us") for r in dec], 0.4, label="portakern (graph)")
        a2.bar([j + 0.2 for j in xs], [frac(r, "cudnn_graph_us") for r in dec], 0.4, label="cuDNN SDPA (graph)")
        a2.axhline(1.0, color="k", lw=0.8)
        a2.set_xticks(list(xs), labels, rotation=60, fontsize=8)
        a2.set_ylabel("fraction of copy-bandwidth floor")
        a2.set_title("decode (32q/8kv heads, D=128)")
        a2.legend(fontsize=8)
    fig.suptitle(f"{res['device'].get('name', '')}, triton {res['versions']['triton']}, {res['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def summary(res):
    """The checks that failed, the pass count, and one line per bench row with its ratios."""
    print("\n== summary ==")
    for r in res.get("check", []):
        if not r["ok"]:
            print("CHECK FAIL", r)
    print(f"checks passed: {sum(r['ok'] for r in res.get('check', []))}/{len(res.get('check', []))}")
    for r in res.get("bench", []):
        if r["kind"] == "prefill":
            pk, cd = r["portakern_tflops"], r["cudnn_tflops"]
            ratio = pk / cd if isinstance(pk, float) and isinstance(cd, float) else None
            print(f"P D{r['D']:<3d} S{r['S']:<5d} c{int(r['causal'])} pk {pk or 0:6.1f} cudnn {cd or 0:6.1f} "
                  f"x{ratio or 0:.2f} flash {r['flash_tflops'] or 0:6.1f}")
        else:
            pk, g = r["portakern_us"], r["portakern_graph_us"]
            cd, cg = r.get("cudnn_us"), r.get("cudnn_graph_us")
            fl = r["floor_us"]
            frac = fl / g if isinstance(g, float) else 0          # the graph figure: eager is launch-bound
            rnd = lambda v: round(v, 1) if isinstance(v, float) else v  # noqa: E731
            print(f"{r['kind'][0].upper()} B{r['B']:<2d} L{r['L']:<6d} p{r['page']:<3d} eager {pk:7.1f} graph {g:7.1f} "
                  f"floor {fl:6.1f} ({frac:.0%} in the graph) cudnn eager {rnd(cd)} graph {rnd(cg)}")
