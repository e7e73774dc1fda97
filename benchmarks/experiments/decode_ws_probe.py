"""Gluon split-KV decode (kernels/attention_decode_ws.py) against float64, then against the table's attn_fwd.

``--phase check``: decode cases (dense and paged, pages of 16 / 64 / 128, GQA 4 and 8, D 64 / 128 / 256,
sequence lengths that end inside a tile and inside a page, one key, splits with no keys) against the cpu
backend's float64 kernel, outputs NaN-poisoned before every call and the K/V rows past each sequence NaN
(they must not reach the output). ``--phase bench``: B=1 at 8k and 32k keys and B=64 at 4k, dense and pages
of 16 and 64, per call in long CUDA graphs (``benchmarks/attention.py``'s ``graph_ms``) for the table's
attn_fwd configuration and the Gluon kernel's tiles, stages and split counts. JSON under --out.
"""

from __future__ import annotations

import math
import os
import sys

from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # benchmarks/ for attention.py
import harness  # noqa: E402

import attention as AB  # noqa: E402
from portakern.backends.cpu.attention import attention_kernel  # noqa: E402
from portakern.backends.triton import attention as A  # noqa: E402
from portakern.backends.triton import attention_decode_ws as DW  # noqa: E402
from portakern.backends.triton.tuning import AttnConfig  # noqa: E402
from portakern.devices import torch_device  # noqa: E402
from portakern.ir import Attention, DType, KVLayout  # noqa: E402


def make_op(B, L, page, Hq, Hkv, D, dtype=DType.bfloat16, seqlens=False):
    """Decode over ``L`` keys (paged: rounded up to whole pages; the lengths come in ``seqlens_k``)."""
    if page:
        L = -(-L // page) * page
    kw = dict(kv_layout=KVLayout.PAGED, page_size=page, num_pages=B * L // page + 5, has_seqlens_k=True) \
        if page else dict(has_seqlens_k=seqlens)
    return Attention(batch=B, seqlen_q=1, seqlen_k=L, heads_q=Hq, heads_kv=Hkv, head_dim=D, head_dim_v=D,
                     dtype=dtype, scale=1 / math.sqrt(D), return_lse=True, **kw).verify()


def kernel(op, dev, cfg):
    return A.build(op, dev, replace(cfg, decode_ws=True))


def poison_tails(op, k, v, aux, lens):
    """NaN in every K/V row a sequence does not own past its length (the rest of its last page or tile)."""
    for b, n in enumerate(lens):
        if op.kv_layout is KVLayout.PAGED:
            ps = op.page_size
            last = aux["block_table"][b, (n - 1) // ps].item() if n else None
            if last is not None and n % ps:
                k[last, n % ps:] = float("nan")
                v[last, n % ps:] = float("nan")
        else:
            k[b, n:] = float("nan")
            v[b, n:] = float("nan")


def reference(op, q, k, v, aux):
    shapes = op.shapes()
    out, lse = np.zeros(shapes["out"]), np.zeros(shapes["lse"])
    npaux = {n: (a.cpu().numpy() if a is not None else None) for n, a in aux.items()}
    attention_kernel(op)(*(t.double().cpu().nan_to_num(0.0).numpy() for t in (q, k, v)), out, lse, npaux)
    return torch.from_numpy(out).to(q.device), torch.from_numpy(lse).to(q.device)


CHECK = [  # (B, L, page, Hq, Hkv, D, lengths or None, splits, stages, block_n)
    (1, 8192, 0, 32, 8, 128, None, 16, 4, 64),
    (3, 1000, 0, 16, 4, 128, [1000, 937, 1], 8, 3, 64),
    (3, 1000, 16, 32, 8, 128, [1000, 937, 1], 8, 3, 64),
    (2, 4096, 64, 32, 8, 128, [4096, 2049], 16, 4, 64),
    (2, 700, 128, 16, 2, 128, [700, 129], 4, 2, 64),
    (2, 1500, 16, 32, 4, 64, [1500, 33], 12, 4, 64),
    (2, 1500, 32, 16, 4, 256, [1500, 500], 6, 3, 64),
    (1, 300, 16, 64, 1, 128, [300], 1, 2, 64),
    (2, 2000, 16, 32, 8, 128, [2000, 77], 1, 2, 128),
    (2, 100, 0, 8, 8, 128, [100, 3], 32, 2, 32),
]


def check(dev) -> list[dict]:
    rows = []
    for B, L, page, Hq, Hkv, D, lens, splits, stages, bn in CHECK:
        for dt in (DType.bfloat16, DType.float16):
            op = make_op(B, L, page, Hq, Hkv, D, dt, seqlens=lens is not None)
            assert DW.blocker(op, "sm_90", bn) is None, DW.blocker(op, "sm_90", bn)
            q, k, v, out, lse, aux = A.random_inputs(op, torch.device("cuda"), seed=3)
            if lens is not None:
                aux["seqlens_k"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
            poison_tails(op, k, v, aux, lens or [L] * B)
            ref, ref_lse = reference(op, q, k, v, aux)
            cfg = AttnConfig(16, bn, 4, stages, pack=op.group_size, num_splits=splits)
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            kernel(op, dev, cfg)(q, k, v, out, lse, aux)
            torch.cuda.synchronize()
            err = (out.double() - ref).abs().max().item()
            lerr = (lse.double() - ref_lse).abs().max().item()
            ok = err < 2e-2 and lerr < 1e-3
            rows.append(dict(case=[B, L, page, Hq, Hkv, D, lens, splits, stages, bn, dt.value], max_err=err,
                             lse_err=lerr, ok=ok))
            print(f"check B{B} L{L} p{page} {Hq}/{Hkv} D{D} lens={lens} splits={splits} st={stages} bn={bn} "
                  f"{dt.value}: err {err:.2e} lse {lerr:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return rows


def bench(dev, shapes) -> list[dict]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = AB.copy_bandwidth()
    rows = []
    for B, L, page in shapes:
        op = AB.decode(B, L, page)
        kv_bytes = 2 * B * L * op.heads_kv * op.head_dim * 2
        sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(AB.n_sets(kv_bytes, l2))]
        table = AB.table_config(op, dev)
        row = dict(B=B, L=L, page=page, floor_us=kv_bytes / bw * 1e6, table=table.to_json(),
                   table_us=AB.graph_ms(AB.ours(op, dev, table, sets)) * 1e3, gluon={})
        q, k, v, out, lse, aux = sets[0]
        AB.ours(op, dev, table, sets[:1])[0]()
        ref = out.clone()
        for bn, st, splits in ((64, 4, 16), (64, 4, 32), (64, 3, 16), (64, 2, 32), (128, 2, 16), (64, 3, 1),
                               (64, 2, 1), (128, 3, 8)):
            if (B > 1) != (splits == 1) or DW.blocker(op, "sm_90", bn):
                continue
            cfg = AttnConfig(16, bn, 4, st, pack=op.group_size, num_splits=splits)
            fns = [(lambda s=s, f=kernel(op, dev, cfg): f(*s)) for s in sets]
            out.fill_(float("nan"))
            fns[0]()
            err = (out.float() - ref.float()).abs().max().item()
            row["gluon"][f"bn{bn}-st{st}-s{splits}"] = AB.graph_ms(fns) * 1e3 if err < 2e-2 else f"ERR {err:.3g}"
        best = min((t for t in row["gluon"].values() if isinstance(t, float)), default=float("nan"))
        print(f"bench B{B:2d} L{L:6d} p{page:3d}: floor {row['floor_us']:7.2f} table {row['table_us']:7.2f} "
              f"gluon best {best:7.2f} | " + " ".join(f"{k} {v if isinstance(v, str) else round(v, 2)}"
                                                     for k, v in row["gluon"].items()), flush=True)
        rows.append(row)
        del sets
    return rows


def main() -> None:
    def extra(ap):
        ap.add_argument("--phase", choices=("check", "bench"), required=True)
        ap.add_argument("--shapes", nargs="+", default=["1:8192:0", "1:8192:16", "1:8192:64", "1:32768:0",
                                                         "1:32768:16", "1:32768:64", "64:4096:0", "64:4096:16"],
                        metavar="B:L:PAGE")

    args = harness.parse_args(__doc__, extra)
    dev = torch_device("cuda", 0)
    res = harness.header(__doc__, 0.0, rows=[])
    if args.phase == "check":
        res["rows"] = check(dev)
    else:
        res["rows"] = bench(dev, [tuple(int(x) for x in s.split(":")) for s in args.shapes])
    harness.write(res, args.out, f"decode-ws-{args.phase}", args.tag)
    if args.phase == "check" and not all(r["ok"] for r in res["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
