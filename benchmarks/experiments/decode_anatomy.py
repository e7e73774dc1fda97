"""Where B=1 split decode's time goes: the table's kernel against the same walk over K and V with parts removed.

Session 12 found that neither the chain across a program's warps (a kernel with one softmax per warp was
5 us slower) nor the fused merge's reductions explain the ~6-8 us per call that B=1 decode spends beyond
streaming its K and V. This experiment measures instead of guessing. For B=1, 32 query / 8 KV heads,
D=128, bf16, dense keys, with the sm_90 table's key tile, stages, splits and pdl, per call inside a CUDA
graph over input sets rotated past 4x the L2 (as ``benchmarks/attention.py``):

* ``table``  -- ``portakern``'s attention (``attn_fwd`` + ``attn_combine``);
* ``dots``   -- ``kv_walk`` MODE 1: the same grid and key tiles, q k^T and P V as ``attn_fwd`` computes
  them, with P = the raw scores (no maximum, exponent or sums) and one value stored per program;
* ``read``   -- ``kv_walk`` MODE 0: the same grid and tiles, K and V summed over their keys by products
  with a matrix of ones (the loads pipelined through shared memory as ``attn_fwd``'s are; streaming at the
  kernel's access pattern with the least arithmetic that keeps that pipeline);
* ``empty``  -- a kernel that does nothing on the same grid (launch and scheduling in a graph).

``table - dots`` prices the softmax and the merge, ``dots - read`` the MMAs and their layout traffic,
``read - floor`` the access pattern and the ramp, ``empty`` the launch.

    python benchmarks/experiments/decode_anatomy.py [--lengths 2048 8192 32768] [--out DIR] [--tag T]
    TRITON_INTERPRET=1 python benchmarks/experiments/decode_anatomy.py --smoke   # the kernels' values, on CPU
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

HQ, HKV, D = 32, 8, 128


@triton.jit
def kv_walk(Q, K, V, OUT, stride_ks, stride_kh, stride_vs, stride_vh, seqlen_k,
            GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            NUM_SPLITS: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    """Split decode's walk over one KV head's keys (B=1, dense) with parts left out (module docstring):
    MODE 0 sums K and V over their keys (products with ones), MODE 1 runs attn_fwd's two dots on the raw
    scores, MODE 2 is MODE 0 over contiguous rows (the same bytes per program, no head interleave)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    # -- this split's key tiles, shared out floor / ceil as attn_fwd does
    n_t = tl.cdiv(seqlen_k, BLOCK_N)
    t_lo = (split * n_t) // NUM_SPLITS
    t_hi = ((split + 1) * n_t) // NUM_SPLITS
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    r = tl.arange(0, BLOCK_M)
    q = tl.load(Q + (kvh * GROUP + r)[:, None] * D + offs_d[None, :], mask=(r < GROUP)[:, None], other=0.0)
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    if MODE == 2:
        # -- the same number of 256-byte rows, contiguous: the cache read as (Hkv * L) rows of one head's
        #    width, program (split, kvh) taking rows kvh L + [t_lo, t_hi) BLOCK_N (contiguous inputs only)
        k_base = K + kvh.to(tl.int64) * seqlen_k * D
        v_base = V + kvh.to(tl.int64) * seqlen_k * D
        stride_ks = D
        stride_vs = D
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for t in tl.range(t_lo, t_hi):
        n = t * BLOCK_N + offs_n
        keep = n < seqlen_k
        v = tl.load(v_base + n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :], mask=keep[:, None], other=0.0)
        if MODE != 1:
            # -- stream only: both tiles summed over their keys by a product with ones (a dot, so the
            #    loads are pipelined through shared memory like attn_fwd's, not register loads)
            k = tl.load(k_base + n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=keep[:, None],
                        other=0.0)
            ones = tl.full([BLOCK_M, BLOCK_N], 1.0, k.dtype)
            acc = tl.dot(ones, v, tl.dot(ones, k, acc))
        else:
            # -- attn_fwd's two products, the scores used as they come
            kt = tl.load(k_base + n.to(tl.int64)[None, :] * stride_ks + offs_d[:, None], mask=keep[None, :],
                         other=0.0)
            s = tl.dot(q, kt)
            acc = tl.dot(s.to(v.dtype), v, acc)
    # -- one value per program keeps everything live
    tl.store(OUT + split * tl.num_programs(1) + kvh, tl.sum(tl.sum(acc, 1), 0))


def walk_fns(sets, out, cfg, mode: int):
    """Graph-capturable calls of ``kv_walk`` over ``sets`` (attention inputs) with ``cfg``'s tile, stages,
    splits and pdl."""
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    opts = {} if interp else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=cfg.pdl)
    grid = (cfg.num_splits, HKV)
    return [(lambda q=q, k=k, v=v: kv_walk[grid](q, k, v, out, k.stride(1), k.stride(2), v.stride(1), v.stride(2),
                                                  k.shape[1], GROUP=HQ // HKV, D=D, BLOCK_M=cfg.block_m,
                                                  BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.num_splits, MODE=mode,
                                                  PDL=cfg.pdl, **opts))
            for q, k, v, *_ in sets]


def b1_decode(L: int, dev, l2: int):
    """B=1 decode of ``L`` dense keys (32 query / 8 KV heads, D=128, bf16): its op, the table's
    configuration, its K+V bytes and input sets rotated past 4x the L2 (as ``benchmarks/attention.py``)."""
    import attention as AB  # noqa: E402  (benchmarks/attention.py)

    from portakern.backends.triton import attention as A

    op = AB.decode(1, L)
    kv_bytes = 2 * L * HKV * D * 2
    sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(AB.n_sets(kv_bytes, l2))]
    return op, AB.table_config(op, dev), kv_bytes, sets


def smoke() -> None:
    """Both modes against torch on CPU tensors (run under TRITON_INTERPRET=1)."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    L, splits = 300, 3
    q = torch.randn(1, 1, HQ, D, generator=g).half()
    k = torch.randn(1, L, HKV, D, generator=g).half()
    v = torch.randn(1, L, HKV, D, generator=g).half()
    cfg = SimpleNamespace(num_warps=4, num_stages=1, pdl=False, num_splits=splits, block_m=16, block_n=32)
    out = torch.zeros(splits * HKV)
    n_t = -(-L // cfg.block_n)
    bounds = [((s * n_t) // splits * cfg.block_n, min(L, ((s + 1) * n_t) // splits * cfg.block_n))
              for s in range(splits)]
    walk_fns([(q, k, v)], out, cfg, 0)[0]()
    want = cfg.block_m * torch.tensor([[(k[0, a:b, h].double() + v[0, a:b, h].double()).sum().item()
                                        for h in range(HKV)] for a, b in bounds])
    err0 = ((out.view(splits, HKV).double() - want).abs().max() / want.abs().max()).item()
    walk_fns([(q, k, v)], out, cfg, 2)[0]()
    # MODE 2 reads the cache as (HKV L) rows: program (split, h) takes rows h L + [a, b)
    want2 = cfg.block_m * torch.tensor([[(k[0].reshape(-1, D)[h * L + a:h * L + b].double()
                                          + v[0].reshape(-1, D)[h * L + a:h * L + b].double()).sum().item()
                                         for h in range(HKV)] for a, b in bounds])
    err2 = ((out.view(splits, HKV).double() - want2).abs().max() / want2.abs().max()).item()
    walk_fns([(q, k, v)], out, cfg, 1)[0]()
    G = HQ // HKV
    want = torch.tensor([[((q[0, 0, h * G:(h + 1) * G].double() @ k[0, a:b, h].double().T).half().double()
                           @ v[0, a:b, h].double()).sum().item() for h in range(HKV)] for a, b in bounds])
    rel1 = ((out.view(splits, HKV).double() - want).abs().max() / want.abs().max()).item()
    print(f"read: max relative err {err0:.3g}; contiguous read {err2:.3g}; dots {rel1:.3g}")
    assert err0 < 1e-2 and err2 < 1e-2 and rel1 < 1e-2, "kv_walk disagrees with torch"


def main() -> None:
    import harness as Hs

    def extra(ap):
        ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
        ap.add_argument("--smoke", action="store_true", help="check the kernels' values on CPU tensors and stop")

    args = Hs.parse_args(__doc__, extra)
    if args.smoke:
        smoke()
        return
    import attention as AB  # noqa: E402  (benchmarks/attention.py)
    from read_floor import empty_kernel  # noqa: E402

    from portakern.devices import torch_device

    dev = torch_device("cuda", 0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = AB.copy_bandwidth()
    res = Hs.header(__doc__, bw / 1e12, rows=[])
    for L in args.lengths:
        op, cfg, kv_bytes, sets = b1_decode(L, dev, l2)
        sink = torch.empty(cfg.num_splits * HKV, device="cuda")
        row = {"L": L, "config": cfg.to_json(), "floor_us": kv_bytes / bw * 1e6,
               "table_us": AB.graph_ms(AB.ours(op, dev, cfg, sets)) * 1e3,
               "dots_us": AB.graph_ms(walk_fns(sets, sink, cfg, 1)) * 1e3,
               "read_us": AB.graph_ms(walk_fns(sets, sink, cfg, 0)) * 1e3,
               "empty_us": AB.graph_ms([lambda: empty_kernel[(cfg.num_splits * HKV,)](sink, PDL=cfg.pdl,
                                                                                       launch_pdl=cfg.pdl)]
                                       * len(sets)) * 1e3}
        res["rows"].append(row)
        print(f"L={L:6d} floor {row['floor_us']:6.2f}  table {row['table_us']:6.2f}  dots {row['dots_us']:6.2f}  "
              f"read {row['read_us']:6.2f}  empty {row['empty_us']:5.2f} us  (splits {cfg.num_splits}, "
              f"BN {cfg.block_n}, stages {cfg.num_stages})", flush=True)
        del sets
    Hs.write(res, args.out, "decode-anatomy", args.tag)


if __name__ == "__main__":
    main()
