"""Why paged B=1 decode is slower than dense: the page-id code path, or the order of the pages in memory?

Session 13's table run (`results/attention-2026-12-04-s13-table.json`): at 32k keys dense decode took 36.2 us,
pages of 64 37.9 (+4.9%), pages of 16 40.1 (+10.9%), on the same 64-key tiles, stages, splits and merge for
both page sizes. Pages of 16 look up a page id per key (a 64-key tile spans four pages); pages of 64 one
per tile. This times the table's kernel on the same caches with the block table shuffled (as the
benchmark) and in order (page ``i`` of the sequence is physical page ``i``: the bytes in dense order), and
dense keys, per call in long CUDA graphs (``benchmarks/attention.py``'s ``graph_ms``). If pages of 16 in
order match dense, the shuffled pages' memory order costs the time; if they match shuffled pages of 16,
the page-id path does.

    python benchmarks/experiments/paged_order.py [--lengths 8192 32768] [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def in_order(sets):
    """The same inputs with each sequence's pages in physical order (block table row b = b P + arange(P))."""
    out = []
    for q, k, v, o, lse, aux in sets:
        bt = aux["block_table"]
        rows, per = bt.shape
        aux = dict(aux, block_table=torch.arange(rows * per, dtype=bt.dtype, device=bt.device).reshape(rows, per))
        out.append((q, k, v, o, lse, aux))
    return out


def main() -> None:
    import harness as Hs

    def extra(ap):
        ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])

    args = Hs.parse_args(__doc__, extra)
    import attention as AB  # noqa: E402  (benchmarks/attention.py)

    from portakern.backends.triton import attention as A
    from portakern.devices import torch_device

    dev = torch_device("cuda", 0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = AB.copy_bandwidth()
    res = Hs.header(__doc__, bw / 1e12, rows=[])
    for L in args.lengths:
        kv_bytes = 2 * L * 8 * 128 * 2
        n = AB.n_sets(kv_bytes, l2)
        op = AB.decode(1, L)
        row = {"L": L, "floor_us": kv_bytes / bw * 1e6,
               "dense_us": AB.graph_ms(AB.ours(op, dev, AB.table_config(op, dev),
                                               [A.random_inputs(op, torch.device("cuda"), seed=i)
                                                for i in range(n)])) * 1e3}
        for page in (16, 64):
            op = AB.decode(1, L, page)
            cfg = AB.table_config(op, dev)
            sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(n)]
            ordered = in_order(sets)
            row[f"p{page}"] = {"config": cfg.to_json(),
                               "shuffled_us": AB.graph_ms(AB.ours(op, dev, cfg, sets)) * 1e3,
                               "in_order_us": AB.graph_ms(AB.ours(op, dev, cfg, ordered)) * 1e3}
            del sets, ordered
        res["rows"].append(row)
        print(f"L={L:6d} floor {row['floor_us']:6.2f}  dense {row['dense_us']:6.2f}  " + "  ".join(
            f"p{p} shuffled {row[f'p{p}']['shuffled_us']:6.2f} in order {row[f'p{p}']['in_order_us']:6.2f}"
            for p in (16, 64)) + " us", flush=True)
    Hs.write(res, args.out, "paged-order", args.tag)


if __name__ == "__main__":
    main()
