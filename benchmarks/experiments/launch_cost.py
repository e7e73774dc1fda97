"""Host cost of one eager call: portakern with and without the fast launch, against the peers.

Eager calls (no CUDA graph) cost what the host spends to enqueue them when that exceeds the GPU's time.
Per callable, rounds of ``--calls`` back-to-back calls: ``host_us`` is the time to enqueue them (the
queue holds far more than one round), ``wall_us`` the time until the GPU has finished too, both per
call, medians over ``--rounds`` rounds; the variants alternate round by round. Callables:

* the quantized GEMV (int4 g128, bf16, M = 1; 4096 x 4096 and 14336 x 4096): ``portakern.quant_gemv``
  (the public API, output allocated per call) and the backend kernel alone on preallocated tensors,
  each with the triton fast launch on and off (``launch.set_fast_launch``; ``[backend]`` names the backend
  dispatch chose, the cuda backend's launch where its table wins), the API forced onto triton; the torch integration's ``QuantLinear``
  (plain eager: no torch dispatch) and ``torch.ops.portakern.quant_gemv`` (dispatched); tinygemm
  (``aten._weight_int4pack_mm``) and bf16 ``F.linear``;
* paged decode attention (B = 1, 32 / 8 heads, D = 128, 2048 keys in pages of 64: the decode step's):
  ``portakern.attention`` on and off; SDPA over the same keys stored densely (its default backend).

    python benchmarks/experiments/launch_cost.py [--calls 100] [--rounds 15] [--profile] [--out DIR] [--tag T]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import portakern  # noqa: E402
from experiments import harness  # noqa: E402
from gemv import bf16_linear, copy_bandwidth_TBps, tinygemm  # noqa: E402
from portakern.backends.triton.launch import set_fast_launch  # noqa: E402
from portakern.quantize import quantize  # noqa: E402


def timed_round(fn, calls: int) -> tuple[float, float]:
    """Per-call microseconds to enqueue ``calls`` calls, and until the GPU finished them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def with_fast(fn, on: bool):
    def call():
        return fn()
    call.fast = on
    return call


def measure(variants: dict, calls: int, rounds: int) -> dict:
    """Alternating rounds of every variant; medians (and the fastest round's host time)."""
    host = {n: [] for n in variants}
    wall = {n: [] for n in variants}
    for fn in variants.values():   # warm: compiles, plans, allocator pools
        set_fast_launch(getattr(fn, "fast", True))
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for n, fn in variants.items():
            set_fast_launch(getattr(fn, "fast", True))
            h, w = timed_round(fn, calls)
            host[n].append(h)
            wall[n].append(w)
    set_fast_launch(True)
    med = statistics.median
    return {n: {"host_us": round(med(host[n]), 2), "host_min_us": round(min(host[n]), 2),
                "wall_us": round(med(wall[n]), 2)} for n in variants}


def gemv_variants(N: int, K: int) -> dict:
    w = quantize(torch.randn(N, K, device="cuda"), bits=4, group_size=128)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    portakern.quant_gemv(x, w)
    plan = [p for k, p in portakern.dispatch._plans.items() if k[0] == "quant_gemv"][-1]
    be = plan.backend
    prepared = w.prepared[(be.weight_layout or be.name, str(plan.decision.device))]
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    kernel = plan.kernel
    api = lambda: portakern.quant_gemv(x, w)   # noqa: E731
    direct = lambda: kernel(x, prepared, out)   # noqa: E731
    from portakern import torch_ops

    p = torch_ops.prepared(w)
    lin = torch_ops.QuantLinear(p)
    via_op = lambda: torch.ops.portakern.quant_gemv(x, p.qweight, p.scales, p.zeros, p.perm, p.kgroup,  # noqa: E731
                                                    p.bits, p.group_size, p.zero_point, p.N, p.K)
    on_triton = lambda: portakern.quant_gemv(x, w, backend="triton")   # noqa: E731
    return {f"portakern_api_fast[{be.name}]": with_fast(api, True), "portakern_api_triton": with_fast(api, False),
            f"portakern_kernel_fast[{be.name}]": with_fast(direct, True),
            "portakern_kernel_triton": with_fast(direct, False), "portakern_api_fast_backend_triton": on_triton,
            "QuantLinear_eager": lambda: lin(x), "torch_ops_dispatched": via_op,
            "tinygemm": tinygemm(1, N, K, 128, 1)[0], "bf16_linear": bf16_linear(1, N, K, 1)[0]}


def attention_variants(ctx: int = 2048, page: int = 64) -> dict:
    hq, hkv, d = 32, 8, 128
    pages = -(-ctx // page)
    q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
    lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    api = lambda: portakern.attention(q, kc, vc, block_table=table, seqlens_k=lens)   # noqa: E731
    qs = q.transpose(1, 2)
    ks = kc[table[0].long()].reshape(1, pages * page, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    vs = vc[table[0].long()].reshape(1, pages * page, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)   # noqa: E731
    return {"portakern_api_fast": with_fast(api, True), "portakern_api_triton": with_fast(api, False), "sdpa": sdpa}


def profile(variants: dict, names: list[str], calls: int = 300) -> None:
    """cProfile of ``calls`` calls of each named variant: the 18 functions with the most own time."""
    import cProfile
    import pstats

    for n in names:
        fn = variants[n]
        set_fast_launch(getattr(fn, "fast", True))
        for _ in range(20):
            fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"== profile {n} ({calls} calls)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    set_fast_launch(True)


def main() -> int:
    args = harness.parse_args(__doc__, lambda ap: (ap.add_argument("--calls", type=int, default=100),
                                                   ap.add_argument("--rounds", type=int, default=15),
                                                   ap.add_argument("--profile", action="store_true",
                                                                   help="also cProfile the API calls")))
    if args.profile:
        profile(attention_variants(), ["portakern_api_fast"])
        for shape in ((4096, 4096), (14336, 4096)):
            v = gemv_variants(*shape)
            profile(v, [n for n in v if n.startswith("portakern_api_fast[")])
    res = harness.header(__doc__, copy_bandwidth_TBps(), rows=[])
    cases = [("quant_gemv 4096x4096", lambda: gemv_variants(4096, 4096)),
             ("quant_gemv 14336x4096", lambda: gemv_variants(14336, 4096)),
             ("attention paged decode B=1 2048", attention_variants)]
    for name, make in cases:
        for variant, r in measure(make(), args.calls, args.rounds).items():
            res["rows"].append({"case": name, "variant": variant, **r})
    harness.write(res, args.out, "launch-cost", args.tag)
    print(f"{'case':34s} {'variant':34s} {'host us':>8s} {'min':>7s} {'wall us':>8s}")
    for r in res["rows"]:
        print(f"{r['case']:34s} {r['variant']:34s} {r['host_us']:8.2f} {r['host_min_us']:7.2f} {r['wall_us']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
