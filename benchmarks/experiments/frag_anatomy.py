"""Where does the fragment-layout GEMV ("frag", M = 2..16) lose against its floor? One run, one process, CUDA graph.

For M = 4 and 16 and each bench shape, the table's "frag" configuration, timed as ``benchmarks/gemv.py`` times it
(graph of back-to-back calls, buffers rotated past 4x the L2), and the same launch with parts removed by the
kernel's measurement-only ``MODE`` (``kernels/gemv_frag.py``; those results are wrong by design):

* ``frag``      the table's kernel
* ``frag_hot``  the same on one buffer set (weights of <= ~40 MB stay in the L2): the kernel's own chain
* ``no_math``   MODE 1: words, scales, zeros and x loaded but only XORed / added (no dequantisation, no MMA)
* ``no_merge``  MODE 2: every K slice stores its partial as the output (no workspace, counter, last-slice loads)
* ``no_x``      MODE 4: x never loaded (a constant tile)
* ``loads``     MODE 3: no arithmetic and no merge: the grid's loads alone
* ``merge_other`` the table's kernel with its other split-K merge (``MERGE``, ``kernels/gemv_frag.py``; a real
                kernel): first checked bit for bit against the table's on a NaN-poisoned output, then timed
* ``read``      the read floor (``read_floor.py``): a plain read of the weight's bytes, best of its shapes

Differences name the parts: frag - no_math = arithmetic not hidden behind the loads; frag - no_merge = split-K
merge; frag - no_x = x traffic; loads - read = grid and access pattern; read - floor = one launch's ramp and tail.
Caveat: a mode compiles to its own register count (``regs`` in the JSON; sm_90a, Triton 3.6: M = 16 127 / 128 /
127 / 72 / 132 for frag / no_math / no_merge / no_x / loads, M = 4 108 / 114 / 96 / 78 / 96), and with it the
programs per SM: no_x in particular gains occupancy, which its figure includes.
M=1's anatomy (the CUDA-core kernel) is ``gemv_anatomy.py``; the M=1 stream kernel's, ``gemv_stream_probe.py``.

    python benchmarks/experiments/frag_anatomy.py [--phase bench|lower] [--ms 4 16] [--out DIR] [--tag T]

``--phase lower`` (no GPU) lowers every mode for sm_90a and prints registers and spills.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

#: kernel MODE of each column (``frag`` and ``frag_hot`` are MODE 0)
MODES = {"no_math": 1, "no_merge": 2, "no_x": 4, "loads": 3}
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (16384, 16384)]


def with_mode(kern, mode: int, merge: int | None = None):
    """A copy of ``kern``'s (built) frag launcher that launches with ``MODE = mode`` (and ``MERGE = merge`` if
    given): ``f(x, w, out)``."""
    import copy

    from portakern.backends.triton.launch import KernelLaunch

    ln = copy.copy(next(iter(kern.launchers.values())))
    if ln.kind != "frag":
        raise ValueError(f"the table chose kind {ln.kind!r}, not 'frag': no MODE to set")
    ln.consts = {**ln.consts, "MODE": mode, **({} if merge is None else {"MERGE": merge})}
    ln.launch = KernelLaunch(ln.fn, ln.grid, ln.consts, ln.opts, False)
    return ln


def _registers(ln) -> int | None:
    """Registers of the kernel ``ln`` (a frag launcher, launched at least once) compiled to: a mode that takes more
    or fewer than the real kernel also changes the programs per SM, which its figure then includes."""
    fast = getattr(ln.launch, "_fast", None)
    return getattr(getattr(fast, "compiled", None), "n_regs", None)


def bench(args) -> None:
    import torch

    import gemv as GB  # benchmarks/gemv.py
    import harness as H
    import read_floor as RF
    from merge_ab import same_bits
    from gemv_anatomy import best_read_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = GB.copy_bandwidth_TBps()
    res = H.header(__doc__, bw, rows=[])
    cols = ["frag", "frag_hot", *MODES, "read"]
    print(f"copy {bw:.3f} TB/s\n{'M':>2} {'shape':>12} {'floor':>6} " + " ".join(f"{c:>9}" for c in cols), flush=True)
    reads = {}
    for M in args.ms:
        for N, K in SHAPES:
            op = GB.gemv_op(M, N, K)
            copies = GB.copies_for(GB.floor_bytes(op))
            row = {"M": M, "N": N, "K": K, "floor_us": GB.floor_bytes(op) / (bw * 1e12) * 1e6}
            try:
                fns, kern = GB.ours(op, None, copies)
                row["frag"] = GB.graph_us(fns)
                row["frag_hot"] = GB.graph_us(fns[:1])
                ln = next(iter(kern.launchers.values()))
                row["cfg"] = ln.cfg.to_json()
                sets = [f.__defaults__[0] for f in fns]          # (x, w, out) of each rotated set
                row["regs"] = {"frag": _registers(ln)}
                for name, mode in MODES.items():
                    mk = with_mode(kern, mode)
                    row[name] = GB.graph_us([(lambda s=s: mk(*s)) for s in sets])
                    row["regs"][name] = _registers(mk)
                # the other split-K merge (a real kernel): checked bit for bit against the table's, then timed
                other = 1 - int(ln.consts["MERGE"])
                mk = with_mode(kern, 0, merge=other)
                row["merge_other"] = {"MERGE": other, "bit_equal": same_bits(ln, mk, sets[0])}
                row["merge_other"]["us"] = GB.graph_us([(lambda s=s: mk(*s)) for s in sets])
                del fns, sets
            except Exception as e:       # recorded; the other shapes go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.empty_cache()
            nbytes = RF.weight_bytes(N, K)
            if (N, K) not in reads:
                reads[(N, K)] = best_read_us(nbytes, sms, GB.copies_for(nbytes))
                torch.cuda.empty_cache()
            row["read"] = reads[(N, K)]
            res["rows"].append(row)
            mo = row.get("merge_other", {})
            print(f"{M:>2} {N:>6}x{K:<5} {row['floor_us']:6.2f} "
                  + " ".join(f"{row[c]:9.2f}" if isinstance(row.get(c), float) else f"{'x':>9}" for c in cols)
                  + (f"  MERGE={mo['MERGE']} {mo.get('us', float('nan')):.2f} equal={mo['bit_equal']}" if mo else "")
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)
    H.write(res, args.out, "frag-anatomy", args.tag)


def lower_modes(M: int, N: int, K: int) -> dict[int, dict]:
    """Every MODE of the sm_90 table's "frag" entry for ``(M, N, K)`` lowered for sm_90a (no GPU), and the table's
    kernel with its other split-K merge (key ``"merge_other"``): per mode its PTX, registers, bytes spilled
    (``ptxas``), MMAs, global atomics (``atom`` and ``red``) and ``MERGE``."""
    from experiments.chain_lowering import ptxas_registers

    from portakern.backends.triton import gemv_tuning as T
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    lay = Q._LayoutStub(op)
    cfg = T.choose(lay, M, N, "sm_90", 132, dtype="bfloat16")
    out = {}
    base = Q._consts_for(op, lay, cfg)
    for mode in (0, *MODES.values(), "merge_other"):
        consts = ({**base, "MERGE": 1 - base["MERGE"]} if mode == "merge_other" else {**base, "MODE": mode})
        ptx = Q._compile_frag_for_target(op, "sm_90a", 90, cfg, Q._kernel_fn(cfg), consts,
                                         _FRAG_POINTERS)["kernels"]["gemv_frag_kernel"]["ptx"]
        regs, spilled = ptxas_registers(ptx)
        out[mode] = {"ptx": ptx, "regs": regs, "spilled": spilled, "mma": ptx.count("mma.sync"),
                     "atomics": ptx.count("atom.global") + ptx.count("red.global"), "merge": consts["MERGE"]}
    return out


def lower() -> int:
    """Every MODE of the table's M=4 and M=16 entries lowered for sm_90a (no GPU): registers and spills."""
    for M, N, K in ((4, 4096, 4096), (16, 28672, 8192), (16, 16384, 16384)):
        for mode, r in lower_modes(M, N, K).items():
            print(f"M={M} {N}x{K} mode {mode}: {r['regs']} registers, {r['spilled']} bytes spilled, "
                  f"{r['mma']} mma, {r['atomics']} atomics", flush=True)
    return 0


#: pointer types of the frag kernel's arguments (bf16 x and output, fp16 scales and zeros)
_FRAG_POINTERS = {"x_ptr": "*bf16", "fw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*bf16",
                  "ws_ptr": "*fp32", "lock_ptr": "*i32"}


if __name__ == "__main__":
    import harness as H

    args = H.parse_args(__doc__, lambda ap: (
        ap.add_argument("--phase", choices=("bench", "lower"), default="bench"),
        ap.add_argument("--ms", type=int, nargs="+", default=[4, 16], help="rows of x (2 to 16: the frag kernel)")))
    raise SystemExit(lower() if args.phase == "lower" else bench(args))
