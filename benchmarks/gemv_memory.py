"""Resident bytes and preparation time of int4 g128 weights on the GPU, per prepared layout, against torchao.

An int4 g128 Llama-3-8B-shaped set of linears (q, k, v, o, gate, up, down of ``--layers`` layers, bf16 weights
made on the GPU) is quantized (``portakern.quantize``, on the device) and prepared ahead of time
(``portakern.prepare``, native tensors released) once per layout of ``portakern.gemv_weight.LAYOUTS``
("words+fragments": the words and the fragment copy; "fragments": each code held once). Measured:

* resident bytes per parameter after preparation: ``torch.cuda.memory_allocated()`` after, minus before (the bf16
  weights are held throughout and not counted), per layer and in all;
* quantize and prepare time (synchronised, after a warm-up on a small weight);
* torchao's int4 weight-only (``quantize_(model, Int4WeightOnlyConfig(group_size=128, int4_packing_format=
  "tile_packed_to_4d"))``, tinygemm's packing) on the same weights in
  the same run, when torchao imports (else recorded as unavailable with the reason), and the same recipe written
  out with torch ops (fp32 group min/max, ``aten._convert_weight_to_int4pack``: tinygemm, the kernel torchao's
  int4 weight-only calls) so a machine without torchao still has a peer;
* ``portakern.quant_gemv`` per layout at M = 1 and 16 on two shapes, in a CUDA graph over weights rotated past
  the L2 (``timing.graph_us``), against tinygemm.

Usage::

    python benchmarks/gemv_memory.py [--layers 2] [--out benchmarks/results]

Writes ``gemv-memory-<card>.json`` (``harness.result_path``). About a minute on an H100. The issue's targets:
<= 0.54 bytes per parameter, quantize + prepare <= 1.5x torchao's ``quantize_``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import default_out, header, result_path, write  # noqa: E402  (benchmarks/ is the script's folder)

#: Llama-3-8B's linears of one layer: (name, N out features, K in features)
LLAMA3_8B = (("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
             ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336))
#: the GEMV shapes timed per layout: (N, K)
GEMV_SHAPES = ((4096, 4096), (14336, 4096))
GROUP = 128


def linears(layers: int) -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of every linear of ``layers`` Llama-3-8B-shaped layers, layer-major."""
    return [(f"layers.{i}.{name}", N, K) for i in range(layers) for name, N, K in LLAMA3_8B]


def per_param(nbytes: int, params: int) -> float:
    return round(nbytes / params, 4)


def _sync():
    import torch

    torch.cuda.synchronize()


def _weights(shapes, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _, N, K in shapes]


def portakern_run(shapes, ws, layout: str) -> dict:
    """Quantize and prepare every weight in ``layout``; bytes and seconds."""
    import torch

    import portakern

    warm = portakern.quantize(ws[0][:256], bits=4, group_size=GROUP)      # kernels loaded outside the timing
    portakern.prepare(warm, "cuda", layout=layout)
    del warm
    gc.collect()
    _sync()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    qs = [portakern.quantize(w, bits=4, group_size=GROUP) for w in ws]
    _sync()
    t1 = time.perf_counter()
    native = torch.cuda.memory_allocated() - base
    for q in qs:
        portakern.prepare(q, "cuda", layout=layout)
    _sync()
    t2 = time.perf_counter()
    resident = torch.cuda.memory_allocated() - base
    params = sum(N * K for _, N, K in shapes)
    per_layer = {}
    for (name, N, K), q in zip(shapes, qs):
        layer = name.split(".")[1]
        b, p = per_layer.get(layer, (0, 0))
        per_layer[layer] = (b + q.prepared_nbytes, p + N * K)
    out = {"layout": layout, "params": params, "native_bytes_per_param": per_param(native, params),
           "resident_bytes_per_param": per_param(resident, params),
           "prepared_bytes_per_param_by_layer": {k: per_param(b, p) for k, (b, p) in per_layer.items()},
           "quantize_s": round(t1 - t0, 4), "prepare_s": round(t2 - t1, 4), "quantize_prepare_s": round(t2 - t0, 4),
           "all_released": all(q.native_released for q in qs)}
    del qs
    gc.collect()
    return out


def torchao_run(shapes, ws) -> dict:
    """torchao's int4 weight-only ``quantize_`` of Linear modules holding the same weights."""
    import torch

    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except Exception as e:   # not installed, or a torchao without the config
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}

    def model(weights):
        m = torch.nn.ModuleList()
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
            lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            m.append(lin)
        return m

    # the tinygemm packing (what e2e_decode.py uses too): torchao 0.17's default int4 packing needs the mslk
    # package, which its wheel does not bring ("Requires mslk >= 1.0.0" on the H100)
    config = dict(group_size=GROUP, int4_packing_format="tile_packed_to_4d")
    try:
        warm = model([ws[0][:256]])
        quantize_(warm, Int4WeightOnlyConfig(**config))
        del warm
        m = model(ws)
        gc.collect()
        _sync()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        quantize_(m, Int4WeightOnlyConfig(**config))
        _sync()
        t = time.perf_counter() - t0
        gc.collect()
        _sync()
        after = torch.cuda.memory_allocated()
    except Exception as e:
        return {"available": False, "reason": f"quantize_ failed: {type(e).__name__}: {str(e)[:300]}"}
    params = sum(N * K for _, N, K in shapes)
    bf16 = 2 * params      # quantize_ replaced each bf16 weight (a copy of ws) by its packed form
    import torchao

    return {"available": True, "version": torchao.__version__, "quantize_s": round(t, 4),
            "resident_bytes_per_param": per_param(after - base + bf16, params)}


def _int4pack(w, inner_k_tiles=8):
    """torchao's int4 weight-only recipe with torch ops: asymmetric fp32 min/max per group of 128, uint8 codes,
    bf16 scales and zeros, ``aten._convert_weight_to_int4pack`` (tinygemm's layout)."""
    import torch

    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4) | codes[:, 1::2], inner_k_tiles)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)   # (K / g, N, 2)
    return packed, sz


def int4pack_run(shapes, ws) -> dict:
    import torch

    _int4pack(ws[0][:256])
    gc.collect()
    _sync()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    packs = [_int4pack(w) for w in ws]
    _sync()
    t = time.perf_counter() - t0
    params = sum(N * K for _, N, K in shapes)
    out = {"quantize_s": round(t, 4), "resident_bytes_per_param": per_param(torch.cuda.memory_allocated() - base,
                                                                              params)}
    del packs
    return out


def gemv_times(layouts) -> list[dict]:
    """Per shape, M and layout: ``portakern.quant_gemv`` in a CUDA graph over weights rotated past the L2, and
    tinygemm on the same shape."""
    import torch

    import portakern
    from gemv_peers import tinygemm
    from timing import copies_for, graph_us

    rows = []
    for N, K in GEMV_SHAPES:
        copies = copies_for(N * K // 2)
        for layout in layouts:
            qs = []
            for i in range(copies):
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
                qs.append(portakern.prepare(portakern.quantize(w, bits=4, group_size=GROUP), "cuda", layout=layout))
            for M in (1, 16):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                fns = [(lambda q=q: portakern.quant_gemv(x, q)) for q in qs]
                try:
                    chosen = portakern.explain(portakern.quant_gemv, x, qs[0]).chosen
                    us = round(graph_us(fns), 2)
                except Exception as e:
                    chosen, us = None, f"failed: {type(e).__name__}: {str(e)[:200]}"
                rows.append({"N": N, "K": K, "M": M, "layout": layout, "backend": chosen, "us": us})
            del qs
            gc.collect()
        for M in (1, 16):
            rows.append({"N": N, "K": K, "M": M, "layout": "tinygemm", "us": round(graph_us(tinygemm(M, N, K, GROUP,
                                                                                                  copies)), 2)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="Llama-3-8B-shaped layers (default 2: 436 M parameters)")
    ap.add_argument("--out", default=default_out(), help="folder of the JSON result (default: $OUT or "
                                                         "benchmarks/results)")
    ap.add_argument("--no-gemv", action="store_true", help="skip the GEMV timings")
    args = ap.parse_args(argv)
    import torch

    from portakern.gemv_weight import LAYOUTS
    from timing import copy_bandwidth_TBps

    if not torch.cuda.is_available():
        print("gemv_memory.py measures GPU memory: it needs a CUDA device", file=sys.stderr)
        return 2
    layouts = [lay for lay in LAYOUTS if lay != "words"]
    shapes = linears(args.layers)
    ws = _weights(shapes)
    res = header(__doc__, round(copy_bandwidth_TBps(), 3), layers=args.layers, shapes=[list(s) for s in shapes])
    res["portakern"] = [portakern_run(shapes, ws, layout) for layout in layouts]
    res["torchao"] = torchao_run(shapes, ws)
    res["int4pack_torch"] = int4pack_run(shapes, ws)
    del ws
    gc.collect()
    res["gemv"] = [] if args.no_gemv else gemv_times(layouts)
    for r in res["portakern"]:
        print(f"{r['layout']:>16}: {r['resident_bytes_per_param']:.4f} B/param resident "
              f"(native {r['native_bytes_per_param']:.4f}), quantize {r['quantize_s']:.3f} s + prepare "
              f"{r['prepare_s']:.3f} s")
    print(f"torchao: {res['torchao']}\nint4pack (torch ops): {res['int4pack_torch']}")
    for r in res["gemv"]:
        print(f"  {r['N']}x{r['K']} M={r['M']:>2} {r['layout']:>16}: {r['us']} us")
    write(res, result_path(args.out, "gemv-memory"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
