"""Launch a few kernels once each between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_kernels.py

Kernels (after a warm-up launch each, outside the profiled range):

* quantized GEMV, int4 g128 asymmetric, M=1, (28672, 8192) and (4096, 14336), the sm_90 table's
  configuration;
* decode attention, B=1, 32 query / 8 KV heads, D=128, bf16, KV 8k and 32k dense, 32k paged with
  pages of 16 and 64 keys (shuffled block table), the table's config;
* prefill attention, B=4, S=4096, 32 heads, D=128, bf16, causal and not, the table's config.

``--only mma``: instead, the tensor-core kernels at (28672, 8192): M=16 with the table's "mma" and
with the "dot" kernel (swapped operands), and "mma" at M=1.

What the stall reasons say decides the next kernel change (see docs/design/): issue-bound
kernels show "selected" and "math pipe throttle" near the top, latency-bound ones "long scoreboard".
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import attention as AB  # noqa: E402  (benchmarks/attention.py)
import gemv_problems as GB  # noqa: E402  (benchmarks/gemv_problems.py)

from portakern.backends.triton.attention import forward as A  # noqa: E402
from portakern.backends.triton.quant_gemv import aot as QA, config as T  # noqa: E402
from portakern.devices import torch_device  # noqa: E402


def tensor_core_launches() -> list:
    """(name, fn) of the tensor-core GEMV kernels at (28672, 8192) (``--only mma``)."""
    out = []
    N, K = 28672, 8192
    for M, kind in ((16, "mma"), (16, "dot"), (1, "mma")):
        op = GB.gemv_op(M, N, K)
        lay = QA.LayoutStub(op)
        cfg = T.choose(lay, 16, N, "sm_90", 132)   # the M=16 table ("mma")
        if kind == "mma":
            cfg = replace(cfg, num_warps=8)
        else:
            cfg = T.fit(T.GemvConfig("dot", 128, 32, 4, 2, 1, 2, swap_ab=True), lay, M)
        fns, _ = GB.ours(op, cfg, 1)
        out.append((f"gemv M={M} {N}x{K} {kind}", fns[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("all", "mma"), default="all")
    args = ap.parse_args()
    if args.only == "mma":
        return _profile(tensor_core_launches())
    launches = []
    for N, K in ((28672, 8192), (4096, 14336)):
        op = GB.gemv_op(1, N, K)
        fns, _ = GB.ours(op, None, 1)
        launches.append((f"gemv {N}x{K} table", fns[0]))
    dev = torch_device("cuda", 0)
    ops = [(f"decode L={L}", AB.decode(1, L)) for L in (8192, 32768)]
    ops += [(f"paged decode L=32768 page {p}", AB.decode(1, 32768, page=p)) for p in (16, 64)]
    ops += [(f"prefill B=4 S=4096 D=128 causal={c}", AB.prefill(4, 4096, 32, 128, c)) for c in (False, True)]
    for name, op in ops:
        sets = [A.random_inputs(op, torch.device("cuda"))]
        launches.append((name, AB.ours(op, dev, AB.table_config(op, dev), sets)[0]))
    _profile(launches)


def _profile(launches) -> None:
    for _, f in launches:   # compile and warm outside the profiled range
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, f in launches:
        print(f"profiling {name}", flush=True)
        f()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
