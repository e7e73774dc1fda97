"""Probe the warp-specialised prefill walk (``AttnConfig.warp_specialize``) on a GPU, one candidate per process.

``attention.build`` refuses the walk on GPUs (session 3: an illegal memory access on the H200). This
script lifts the refusal in a child process per candidate (``attention.WS_GPU_PROBE``), so a fault
kills only that child: each candidate of ``tuning.tma_candidates`` runs on a small problem (B=1, S=512,
2 heads, D=128: checked against float64), then on the benchmark problem (B=4, S=4096, 32 heads, D=128,
causal and not: checked against the table configuration's output and timed against it, CUDA events
via ``do_bench``). With ``--sanitize`` the small problem runs under ``compute-sanitizer --tool memcheck``
and the first report lines are kept.

    python benchmarks/experiments/attention_ws_probe.py [--sanitize] [--only small,4k,4k-causal] [--block-m 64]
                                                        [--out DIR] [--tag=T]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attention as AB  # noqa: E402  (benchmarks/attention.py)
sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

from portakern.backends.triton import attention as A  # noqa: E402
from portakern.backends.triton import tuning  # noqa: E402
from portakern.devices import torch_device  # noqa: E402


def problems():
    """(name, op) of the small checked problem and the two benchmark problems."""
    return [("small", AB.prefill(1, 512, 2, 128, False)), ("4k", AB.prefill(4, 4096, 32, 128, False)),
            ("4k-causal", AB.prefill(4, 4096, 32, 128, True))]


def candidates(op):
    dev = torch_device("cuda", 0)
    arch = A._device_arch(dev)[0]
    return [c for c in tuning.tma_candidates(op, AB.table_config(op, dev), arch) if c.warp_specialize]


def reference(q, k, v, causal):
    """float64 softmax(q k^T / sqrt(D)) v on the GPU, (B, S, H, D) layout."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


def child(name: str, index: int) -> dict:
    """Run candidate ``index`` on problem ``name`` in this process; the result as a dict."""
    A.WS_GPU_PROBE = True
    op = dict(problems())[name]
    cfg = candidates(op)[index]
    dev = torch_device("cuda", 0)
    q, k, v, out, lse, aux = A.random_inputs(op, torch.device("cuda"))
    out.fill_(float("nan"))
    kern = A.build(op, dev, cfg)
    kern(q, k, v, out, lse, aux)
    torch.cuda.synchronize()
    row = {"problem": name, "config": cfg.to_json()}
    if name == "small":
        err = (out.double() - reference(q, k, v, op.mask_mod is not None)).abs().max().item()
        row["max_abs_err_vs_float64"] = err
        return row
    base = A.build(op, dev, AB.table_config(op, dev))
    ref = torch.empty_like(out)
    base(q, k, v, ref, lse, aux)
    torch.cuda.synchronize()
    row["max_abs_diff_vs_table"] = (out.float() - ref.float()).abs().max().item()
    row["us"] = AB.bench_ms(lambda: kern(q, k, v, out, lse, aux)) * 1e3
    row["table_us"] = AB.bench_ms(lambda: base(q, k, v, ref, lse, aux)) * 1e3
    return row


def run_child(name, index, sanitize):
    cmd = [sys.executable, __file__, "--child", name, str(index)]
    if sanitize:
        cmd = [shutil.which("compute-sanitizer") or "compute-sanitizer", "--tool", "memcheck",
               "--print-limit", "4"] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"problem": name, "index": index}
    row["rc"] = p.returncode
    if p.returncode or sanitize:
        row["log"] = (p.stdout + p.stderr)[-3000:]
    return row


def _options(ap):
    ap.add_argument("--sanitize", action="store_true", help="run the small problem under compute-sanitizer memcheck")
    ap.add_argument("--only", type=lambda v: v.split(","), help="comma-separated problems: small, 4k, 4k-causal")
    ap.add_argument("--block-m", type=int, help="only the candidates with this block_m")
    ap.add_argument("--child", nargs=2, metavar=("PROBLEM", "INDEX"), help=argparse.SUPPRESS)


def main():
    args = H.parse_args(__doc__, _options)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return
    res = H.header(__doc__, 0.0, rows=[])
    for name, op in problems():
        if args.only and name not in args.only:
            continue
        for i, cfg in enumerate(candidates(op)):
            if args.block_m and cfg.block_m != args.block_m:
                continue
            row = run_child(name, i, args.sanitize and name == "small")
            res["rows"].append(row)
            H.write(res, args.out, "attention-ws-probe", args.tag)   # after every candidate: a timeout loses none
            brief = {k: row.get(k) for k in ("rc", "max_abs_err_vs_float64", "max_abs_diff_vs_table", "us", "table_us")}
            print(name, cfg.block_m, cfg.block_n, cfg.num_stages, brief, flush=True)
            if row["rc"] and "log" in row:
                print(row["log"][-1500:], flush=True)
    if not res["rows"]:
        H.write(res, args.out, "attention-ws-probe", args.tag)


if __name__ == "__main__":
    main()
