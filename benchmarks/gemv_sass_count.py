"""Static instruction count of the int4 M=1 GEMV kernel's main loop, per dequantization variant.

No GPU needed: each variant is lowered for sm_90a through the backend's ``compile_for_target``
(the launch configuration of the sm_90 table, with ``dq`` forced), the cubin is disassembled with
``nvdisasm`` (PATH, else the copy in Triton's wheel; ``cuobjdump -sass`` as a fallback), and the
instructions between the target of the one backward branch (the ``kw0`` loop; the code-position
loop is unrolled) and that branch are counted, per opcode and per code a thread handles in
one iteration (``BKW * BN * (32 / bits) / (32 * num_warps)``). Without a disassembler the PTX of the loop is
counted instead (marked ``"unit": "ptx"``).

    python benchmarks/gemv_sass_count.py [--out FILE] [--dq 0 1 2 3] [--shape N K] [--dtype bfloat16]
                                         [--warps 4 8] [--bits 4 8] [--tiles word-rows group-rows]
                                         [--cols 4 8] [--rows 8 16]

``--tiles``: the per-word-row tile of the table (``word-rows``, the default) and/or the group-resident
tile (``group-rows``: ``--cols`` columns per thread, so ``block_n = 32 * cols * warps``, and ``--rows``
word rows per tile); ``tensor-core``: the M=16 kernels instead, the "dot" kernel (swapped operands)
and the "mma" kernel with either x path, 64 / 128 columns, 1 / 3 stages (``--dq`` ignored); ``stream``:
the M=1 stream-K kernel (kind "stream"), whose loop body holds its rare segment end inline, so the
path an ordinary unit takes is counted (``sass_hot_path``).

Prints one line per (variant, configuration) and writes the JSON (default
``benchmarks/results/gemv-sass-count-<target>.json``, e.g. ``gemv-sass-count-sm90a.json``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from portakern.backends.triton import quant_gemv as Q
from portakern.backends.triton import tuning as tables
from portakern.backends.triton.common.arch import arch_family
from portakern.backends.triton.quant_gemv import aot as QA, config as tuning
from portakern.ir import DType, QuantFormat
from portakern.ir.ops import QuantGemv

TARGET = "sm_90a"
DQ_NAMES = {0: "I2F convert", 1: "OR 2^23, FADD -2^23", 2: "OR 2^23 in place, FADD, 2^-pos in x (table default)",
            3: "subnormal codes: AND only, 2^(149-pos-64) in x (new, unmeasured)"}


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(p) if p.exists() else None
    except Exception:
        return None


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(SASS text, tool used) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        nvd = _tool("nvdisasm")
        if nvd:
            return subprocess.run([nvd, "-c", path], capture_output=True, text=True, check=True).stdout, nvd
        cuo = _tool("cuobjdump")
        if cuo:
            return subprocess.run([cuo, "-sass", path], capture_output=True, text=True, check=True).stdout, cuo
        return "", ""
    finally:
        os.unlink(path)


def registers(cubin: bytes) -> int | None:
    cuo = _tool("cuobjdump")
    if not cuo:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([cuo, "-res-usage", path], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+)", out)
        return int(m.group(1)) if m else None
    finally:
        os.unlink(path)


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_loop(sass: str) -> dict:
    """Opcode counts of the largest loop (backward branch) in nvdisasm / cuobjdump output."""
    ins = []   # (address, opcode, operands)
    labels = {}
    for line in sass.splitlines():
        lab = re.match(r"\s*(\.L\w+):", line)
        if lab:
            labels[lab.group(1)] = None
            pending = lab.group(1)
            labels[pending] = len(ins)
            continue
        m = _SASS.search(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    addr_index = {a: i for i, (a, _, _) in enumerate(ins)}
    loops = []
    for i, (a, op, args) in enumerate(ins):
        if not op.startswith("BRA"):
            continue
        t = re.search(r"(\.L\w+)", args)
        if t and t.group(1) in labels:
            j = labels[t.group(1)]
        else:
            h = re.search(r"0x([0-9a-f]+)", args)
            j = addr_index.get(int(h.group(1), 16)) if h else None
        if j is not None and j <= i:
            loops.append((i - j + 1, j, i))
    if not loops:
        raise RuntimeError("no backward branch found in the SASS")
    n, j, i = max(loops)
    body = [op.split(".")[0] for _, op, _ in ins[j:i + 1]]
    return {"instructions": n, "by_opcode": dict(collections.Counter(body).most_common()),
            "loops_found": len(loops)}


def sass_hot_path(sass: str) -> dict:
    """Opcode counts of the largest loop's common path: from its head to the first branch that jumps to its
    latch block (the one holding the backward branch), plus that block. For loops whose body carries a rare
    block inline (the stream kernel's segment end), this is what an ordinary iteration executes."""
    ins, labels = [], {}
    for line in sass.splitlines():
        lab = re.match(r"\s*(\.L\w+):", line)
        if lab:
            labels[lab.group(1)] = len(ins)
            continue
        m = _SASS.search(line)
        if m:
            ins.append((m.group(3), m.group(4)))
    loops = []
    for i, (op, args) in enumerate(ins):
        t = re.search(r"(\.L\w+)", args)
        if op.startswith("BRA") and t and t.group(1) in labels and labels[t.group(1)] <= i:
            loops.append((i - labels[t.group(1)], labels[t.group(1)], i))
    if not loops:
        raise RuntimeError("no backward branch found in the SASS")
    _, head, back = max(loops)
    latch = max((pos, name) for name, pos in labels.items() if head < pos <= back)
    skip = next((k for k in range(head, back) if ins[k][0].startswith("BRA") and f"{latch[1]})" in ins[k][1]
                 or ins[k][0].startswith("BRA") and re.search(re.escape(latch[1]) + r"\b", ins[k][1])), None)
    if skip is None:
        raise RuntimeError("the loop has no branch to its latch block")
    body = [op.split(".")[0] for op, _ in ins[head:skip + 1] + ins[latch[0]:back + 1]]
    return {"instructions": len(body), "by_opcode": dict(collections.Counter(body).most_common()),
            "loops_found": len(loops)}


def ptx_loop(ptx: str) -> dict:
    """Fallback: PTX instructions between the loop's label and its backward ``bra``."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if re.match(r"^\$L__\w+:$", ln)}
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"bra(\.uni)?\s+(\$L__\w+);", ln)
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            j = labels[m.group(2)]
            body = [x.split()[0].lstrip("@%!p0123456789 ") for x in lines[j + 1:i + 1]
                    if x and not x.startswith(("//", "$", "{", "}", ".")) and x.endswith(";")]
            if best is None or len(body) > best["instructions"]:
                best = {"instructions": len(body),
                        "by_opcode": dict(collections.Counter(b.split(".")[0] for b in body).most_common())}
    if best is None:
        raise RuntimeError("no backward branch found in the PTX")
    return best


def count(op: QuantGemv, cfg: tuning.GemvConfig) -> dict:
    """Static counts of ``cfg``'s main loop (kind "stream": its common path, ``sass_hot_path``)."""
    r = Q.compile_for_target(op, TARGET, cfg)
    (name, k), = r["kernels"].items()
    cubin, ptx = k["cubin"], k["ptx"] or ""
    codes = cfg.block_kw * cfg.block_n * (32 // op.fmt.bits) // (32 * cfg.num_warps)
    sass, tool = disassemble(cubin) if cubin else ("", "")
    walk = sass_hot_path if cfg.kind == "stream" else sass_loop
    loop, unit = (walk(sass), "sass") if sass else (ptx_loop(ptx), "ptx")
    return {"kernel": name, "config": r["config"], "unit": unit, "tool": os.path.basename(tool) if tool else None,
            "codes_per_thread_per_iteration": codes, "loop_instructions": loop["instructions"],
            "per_code": round(loop["instructions"] / codes, 3), "by_opcode": loop["by_opcode"],
            "registers": registers(cubin) if cubin else None,
            "ptx_ftz_arith": len(re.findall(r"\b(?:fma|mul|add|sub)\.\w*\.?ftz\.f32", ptx)),
            "cubin_bytes": len(cubin or b"")}


def tensor_core_rows(N: int, K: int, dtype: str) -> list[dict]:
    """Static counts of the M=16 tensor-core kernels (int4 g128 asymmetric)."""
    op = QuantGemv(M=16, N=N, K=K, dtype=DType(dtype), fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    lay = QA.LayoutStub(op)
    cfgs = [tuning.GemvConfig("dot", 128, 32, 4, 2, 1, 2, swap_ab=True)]
    cfgs += [tuning.GemvConfig("mma", bn, 16, 4, st, 1, x_runs=xr) for bn in (64, 128) for st in (1, 3)
             for xr in (False, True)]
    out = []
    for c in cfgs:
        cfg = tuning.fit(c, lay, 16)
        r = count(op, cfg)
        r.update({"M": 16, "N": N, "K": K, "dtype": dtype, "bits": 4, "tiles": "tensor-core"})
        out.append(r)
        print(f"M=16 {cfg.kind} bn{cfg.block_n} kw{cfg.block_kw} w{cfg.num_warps} st{cfg.num_stages}"
              f"{' x_runs' if cfg.x_runs else ''}{' swap' if cfg.swap_ab else ''}: {r['loop_instructions']:4d} "
              f"{r['unit']} instr / {r['codes_per_thread_per_iteration']} codes = {r['per_code']:.2f}/code  "
              f"regs {r['registers']}", flush=True)
    return out


def stream_rows(N: int, K: int, dtype: str) -> list[dict]:
    """Static counts of the M=1 stream-K kernel (int4 g128, asymmetric and symmetric): 256 and 128
    columns, one and two units ahead (per unit: the common path of its loop)."""
    out = []
    for sym in (False, True):
        op = QuantGemv(M=1, N=N, K=K, dtype=DType(dtype), fmt=QuantFormat(bits=4, group_size=128, symmetric=sym))
        lay = QA.LayoutStub(op)
        for bn, ahead in ((256, 1), (256, 2), (128, 1)):
            cfg = tuning.fit(tuning.GemvConfig("stream", bn, 16, prefetch=ahead, pdl=True), lay, 1)
            r = count(op, cfg)
            r.update({"M": 1, "N": N, "K": K, "dtype": dtype, "bits": 4, "symmetric": sym, "tiles": "stream",
                      "table_config": cfg == tuning.choose(lay, 1, N, "sm_90", 132)})
            out.append(r)
            print(f"stream {'sym ' if sym else 'asym'} bn{bn} ahead{ahead}: {r['loop_instructions']:4d} {r['unit']} "
                  f"instr / {r['codes_per_thread_per_iteration']} codes = {r['per_code']:.2f}/code  "
                  f"regs {r['registers']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"benchmarks/results/gemv-sass-count-{TARGET.replace('_', '')}.json",
                    help="the result file (default benchmarks/results/gemv-sass-count-<target>.json)")
    ap.add_argument("--dq", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--shape", type=int, nargs=2, default=[28672, 8192], metavar=("N", "K"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--bits", type=int, nargs="+", default=[4], choices=[4, 8])
    ap.add_argument("--tiles", nargs="+", default=["word-rows"],
                    choices=["word-rows", "group-rows", "tensor-core", "stream"])
    ap.add_argument("--cols", type=int, nargs="+", default=[4, 8], help="group-rows: columns per thread")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16], help="group-rows: word rows per tile")
    args = ap.parse_args()
    N, K = args.shape
    rows = []
    if "tensor-core" in args.tiles:
        rows += tensor_core_rows(N, K, args.dtype)
    if "stream" in args.tiles:
        rows += stream_rows(N, K, args.dtype)
    for bits, sym in [(b, s) for b in args.bits for s in (False, True)]:
        op = QuantGemv(M=1, N=N, K=K, dtype=DType(args.dtype), fmt=QuantFormat(bits=bits, group_size=128, symmetric=sym))
        arch = arch_family(QA.TARGETS[TARGET])
        lay = QA.LayoutStub(op)
        table = tuning.choose(lay, 1, N, arch, tables.DEFAULT_SMS[arch])
        for tiles in [t for t in args.tiles if t not in ("tensor-core", "stream")]:
            base = tuning.choose(lay, 1, N, arch, tables.DEFAULT_SMS[arch], group_rows=tiles == "group-rows",
                                 stream=False)
            shapes = ([(w, base.block_n, base.block_kw) for w in args.warps] if not base.group_rows else
                      [(w, 32 * c * w, r) for w in args.warps for c in args.cols for r in args.rows])
            for w, bn, bkw in shapes:
                for dq in args.dq:
                    cfg = tuning.fit(replace(base, num_warps=w, block_n=bn, block_kw=bkw, dq=dq), lay, 1)
                    r = count(op, cfg)
                    r.update({"dq": dq, "variant": DQ_NAMES.get(dq, "?"), "bits": bits, "symmetric": sym, "N": N,
                              "K": K, "dtype": args.dtype, "tiles": "group-rows" if cfg.group_rows else "word-rows",
                              "interleave": lay.interleave, "table_config": cfg == table})
                    rows.append(r)
                    top = ", ".join(f"{o} {c}" for o, c in list(r["by_opcode"].items())[:8])
                    print(f"int{bits} {'sym ' if sym else 'asym'} {r['tiles']} bn{cfg.block_n} kw{cfg.block_kw} w{w} "
                          f"dq{dq}: {r['loop_instructions']:4d} {r['unit']} instr / "
                          f"{r['codes_per_thread_per_iteration']} codes = {r['per_code']:.2f}/code  regs {r['registers']}"
                          f"  ftz {r['ptx_ftz_arith']}  [{top}]", flush=True)
    import triton

    res = {"what": "instructions in the main (kw0) loop of the gemv kernels (gemv_fma_kernel g128 M=1 per tile and "
                   "dq variant; with --tiles tensor-core the M=16 kernels), per code; static (compiled here, not run)",
           "date": datetime.date.today().isoformat(), "target": TARGET, "triton": triton.__version__,
           "command": "python " + " ".join([sys.argv[0]] + sys.argv[1:]), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
