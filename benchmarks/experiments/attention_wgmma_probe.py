"""Gluon sm_90 prefill (kernels/attention_wgmma.py) against float64, the table's attn_fwd and cuDNN.

``--phase check``: small dense cases (partial tiles, GQA, causal with seqlen_k > seqlen_q, LSE) against
the cpu backend's float64 kernel, outputs poisoned before every candidate. ``--phase bench``: the
prefill rows of benchmarks/attention.py (``--head-dims``, default 128 64) timed for attn_fwd's table
tile, each Gluon tile with and without ping-pong (checked against attn_fwd's output first), cuDNN and
flash SDPA in the same process; TFLOP/s and ratios to cuDNN. JSON under --out.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # benchmarks/ for attention.py
import harness  # noqa: E402
from attention import bench_ms, prefill, sdpa_fns  # noqa: E402
from portakern.backends.cpu.attention import attention_kernel  # noqa: E402
from portakern.backends.triton import attention as A  # noqa: E402
from portakern.backends.triton import attention_wgmma as W  # noqa: E402
from portakern.backends.triton import tuning  # noqa: E402
from portakern.backends.triton.tuning import AttnConfig  # noqa: E402
from portakern.devices import torch_device  # noqa: E402
from portakern.ir import Attention, DType  # noqa: E402
from portakern.ir import expr as E  # noqa: E402

#: ``(block_n, V ring, K ring)`` per head dim when --tiles is not given (K ring 0: the V ring's depth)
DEFAULT_TILES = {"wide": ((64, 2, 0), (64, 2, 3), (32, 3, 0), (32, 4, 0), (32, 4, 5)),
                 "narrow": ((128, 2, 0), (64, 3, 0), (64, 4, 0), (128, 3, 0), (128, 2, 4))}
TILES: dict[int, tuple] = {}            # --tiles, per head dim
PINGPONG = (False, True)                # --pingpong


def candidates(D: int) -> list[tuple[str, AttnConfig, bool]]:
    """``(label, config, ping-pong)`` for head dim ``D``."""
    tiles = TILES.get(D) or DEFAULT_TILES["wide" if D > 128 else "narrow"]
    return [(f"BN{bn}-st{st}{f'-k{ks}' if ks else ''}{'-pp' if pp else ''}",
             AttnConfig(128, bn, 4, st, wgmma=True, k_stages=ks), pp)
            for pp in PINGPONG for bn, st, ks in tiles]


def build(op, dev, cfg, pingpong: bool):
    W.PINGPONG = pingpong      # read by attention_wgmma.constexprs when the kernel is built
    try:
        return A.build(op, dev, cfg)
    finally:
        W.PINGPONG = False


def reference(op: Attention, q, k, v):
    """The cpu backend's float64 output (B, Sq, Hq, D) and LSE (B, Hq, Sq), on ``q``'s device."""
    shapes = op.shapes()
    out, lse = np.zeros(shapes["out"]), np.zeros(shapes["lse"])
    attention_kernel(op)(*(t.double().cpu().numpy() for t in (q, k, v)), out, lse, {})
    return torch.from_numpy(out).to(q.device), torch.from_numpy(lse).to(q.device)


def check(dev, head_dims) -> list[dict]:
    cases = [(2, 300, 300, 4, 2, 128, False), (2, 300, 300, 4, 2, 128, True), (1, 200, 700, 8, 1, 128, True),
             (2, 257, 513, 4, 4, 64, False), (1, 128, 128, 2, 2, 64, True), (1, 1000, 1000, 2, 1, 128, True),
             (2, 300, 300, 4, 2, 256, False), (1, 200, 700, 8, 1, 256, True), (1, 1000, 1000, 2, 1, 256, True)]
    rows = []
    for B, Sq, Sk, Hq, Hkv, D, causal in (c for c in cases if c[5] in head_dims):
        for dt in (DType.bfloat16, DType.float16):
            op = Attention(batch=B, seqlen_q=Sq, seqlen_k=Sk, heads_q=Hq, heads_kv=Hkv, head_dim=D, head_dim_v=D,
                           dtype=dt, scale=1 / math.sqrt(D), mask_mod=E.causal_mask() if causal else None,
                           return_lse=True)
            assert W.blocker(op, "sm_90") is None, W.blocker(op, "sm_90")
            q, k, v, out, lse, aux = A.random_inputs(op, torch.device("cuda"), seed=1)
            ref, ref_lse = reference(op, q, k, v)
            for label, cfg, pp in candidates(D):
                out.fill_(float("nan"))       # poisoned before every candidate
                lse.fill_(float("nan"))
                build(op, dev, cfg, pp)(q, k, v, out, lse, aux)
                torch.cuda.synchronize()
                err = (out.double() - ref).abs().max().item()
                lerr = (lse.double() - ref_lse).abs().max().item()
                ok = err < 2e-2 and lerr < 1e-3
                rows.append(dict(case=[B, Sq, Sk, Hq, Hkv, D, causal, dt.value], config=cfg.to_json(),
                                 pingpong=pp, max_err=err, lse_err=lerr, ok=ok))
                print(f"check {B} {Sq:5d} {Sk:5d} {Hq}/{Hkv} D{D} causal={causal:d} {dt.value:8s} "
                      f"{label}: err {err:.2e} lse {lerr:.2e} {'ok' if ok else 'FAIL'}",
                      flush=True)
    return rows


def bench(dev, head_dims) -> list[dict]:
    rows = []
    for D, H in ((d, 16 if d > 128 else 32) for d in head_dims):
        for S, B in ((4096, 4), (16384, 1), (1024, 16)):
            for causal in (False, True):
                op = prefill(B, S, H, D, causal)
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                q, k, v, out, lse, aux = A.random_inputs(op, torch.device("cuda"))
                table = A.build(op, dev, tuning.choose(op, *A._device_arch(dev), wgmma=False))   # attn_fwd
                t_table = bench_ms(lambda: table(q, k, v, out, lse, aux)) * 1e3
                ref = out.clone()
                row = dict(shape=[B, S, H, D, causal], table_us=t_table, wgmma={})
                for name in ("cudnn", "flash"):
                    f = sdpa_fns(op, [(q, k, v)], name)[0]
                    row[f"{name}_us"] = bench_ms(f) * 1e3
                for label, cfg, pp in candidates(D):
                    kern = build(op, dev, cfg, pp)
                    out.fill_(float("nan"))
                    kern(q, k, v, out, lse, aux)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = bench_ms(lambda: kern(q, k, v, out, lse, aux)) * 1e3 if err < 2e-2 else f"ERR {err:.3g}"
                    row["wgmma"][label] = t
                best = min((t for t in row["wgmma"].values() if isinstance(t, float)), default=float("nan"))
                tf = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
                print(f"bench B{B} S{S:6d} D{D} causal={causal:d}: table {tf(t_table):5.0f} wgmma best {tf(best):5.0f} "
                      f"cudnn {tf(row['cudnn_us']):5.0f} flash {tf(row['flash_us']):5.0f} TFLOP/s | "
                      f"wgmma/cudnn {row['cudnn_us'] / best:.2f} table/cudnn {row['cudnn_us'] / t_table:.2f} | "
                      + " ".join(f"{k} {v if isinstance(v, str) else round(tf(v))}" for k, v in row["wgmma"].items()),
                      flush=True)
                rows.append(row)
    return rows


def main() -> None:
    def extra(ap):
        ap.add_argument("--phase", choices=("check", "bench"), required=True)
        ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
        ap.add_argument("--tiles", nargs="+", default=[], metavar="D:BN:V[:K]",
                        help="Gluon tiles to run for head dim D: key tile BN, V ring V, K ring K (default V's)")
        ap.add_argument("--pingpong", choices=("off", "on", "both"), default="both")

    args = harness.parse_args(__doc__, extra)
    global PINGPONG
    PINGPONG = {"off": (False,), "on": (True,), "both": (False, True)}[args.pingpong]
    for t in args.tiles:
        parts = [int(x) for x in t.split(":")]
        if len(parts) not in (3, 4):
            sys.exit(f"--tiles {t}: expected D:BN:V or D:BN:V:K (head dim, key tile, V ring, K ring)")
        TILES.setdefault(parts[0], []).append(tuple(parts[1:]) + (0,) * (4 - len(parts)))
    dev = torch_device("cuda", 0)
    res = harness.header(__doc__, 0.0, rows=[])
    res["rows"] = check(dev, args.head_dims) if args.phase == "check" else bench(dev, args.head_dims)
    harness.write(res, args.out, f"attention-wgmma-{args.phase}", args.tag)
    if args.phase == "check" and not all(r["ok"] for r in res["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
