"""The "frag" GEMV kernel's measurement-only ``MODE`` (``backends/triton/kernels/gemv_frag.py``) removes exactly the
part it names, and the real kernel (MODE 0) is what the backend compiles; its two split-K merges (``MERGE``) lower
with the same loop and their own atomics. All lowered for sm_90a with Triton's bundled ptxas, no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="lowers to PTX with the compiler, which the interpreter replaces")

#: the kernel's MODE bits: 1 the arithmetic, 2 the split-K merge, 4 the x loads (3: loads only)
MODES = {"no_math": 1, "no_merge": 2, "no_x": 4, "loads": 3}
#: pointer types of the frag kernel's arguments (bf16 x and output, fp16 scales and zeros)
FRAG_POINTERS = {"x_ptr": "*bf16", "fw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*bf16",
                 "ws_ptr": "*fp32", "lock_ptr": "*i32"}


def spilled_bytes(ptx: str) -> int | None:
    """Bytes of spill stores ptxas reports for ``ptx`` on sm_90a (None where it says nothing)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores", p.stderr)
    return int(m.group(1)) if m else None


def lower_modes(M: int, N: int, K: int) -> dict:
    """Every MODE of the sm_90 table's "frag" entry for ``(M, N, K)`` lowered for sm_90a, and the table's kernel with
    its other split-K merge (key ``"merge_other"``): per mode its PTX, bytes spilled, MMAs, global atomics, MERGE."""
    from portakern.backends.triton.quant_gemv import aot as QA, config as T, launcher as QL
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    lay = QA.LayoutStub(op)
    cfg = T.choose(lay, M, N, "sm_90", 132, dtype="bfloat16")
    base = QL.constexprs(op, lay, cfg)
    out = {}
    for mode in (0, *MODES.values(), "merge_other"):
        consts = {**base, "MERGE": 1 - base["MERGE"]} if mode == "merge_other" else {**base, "MODE": mode}
        ptx = QA._compile_frag_for_target(op, "sm_90a", 90, cfg, QL.kernel_fn(cfg), consts,
                                         FRAG_POINTERS)["kernels"]["gemv_frag_kernel"]["ptx"]
        out[mode] = {"ptx": ptx, "spilled": spilled_bytes(ptx), "mma": ptx.count("mma.sync"),
                     "atomics": ptx.count("atom.global") + ptx.count("red.global"), "merge": consts["MERGE"]}
    return out


def _wide_loads(r: dict) -> dict:
    return {m: v["ptx"].count("ld.global.v4") + v["ptx"].count("ld.global.nc.v4") for m, v in r.items()}


@pytest.mark.parametrize("M, N, K", [(4, 4096, 4096), (16, 28672, 8192)])
def test_each_mode_removes_its_part_and_mode_0_is_the_backend_kernel(M, N, K):
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    r = lower_modes(M, N, K)
    op = QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))
    backend = Q.compile_for_target(op, "sm_90a")["kernels"]["gemv_frag_kernel"]["ptx"]
    assert r[0]["ptx"] == backend                                       # MODE 0 is what every launch runs
    assert r[0]["mma"] > 0 and r[0]["atomics"] > 0                      # the table splits K for these shapes
    assert r[MODES["no_math"]]["mma"] == 0 and r[MODES["no_math"]]["atomics"] == r[0]["atomics"]
    assert r[MODES["no_merge"]]["atomics"] == 0 and r[MODES["no_merge"]]["mma"] == r[0]["mma"]
    assert r[MODES["loads"]]["mma"] == 0 and r[MODES["loads"]]["atomics"] == 0
    wide = _wide_loads(r)
    assert wide[MODES["no_x"]] < wide[0]                                # x's 16-byte tiles gone, the words stay
    assert wide[MODES["no_math"]] == wide[0] and wide[MODES["no_merge"]] == wide[0]
    assert all(v["spilled"] == 0 for v in r.values()), {m: v["spilled"] for m, v in r.items()}


@pytest.mark.parametrize("M, N, K", [(4, 4096, 4096), (16, 28672, 8192)])
def test_the_other_split_k_merge_lowers_with_the_same_loop_and_its_own_atomics(M, N, K):
    """MERGE = 1 (the grid's last slice merges): the chunk loop is untouched (same MMAs and wide loads), nothing
    spills, the publishing slices count with a release atomic, the merging slice polls with acquire atomics in a
    loop and resets the count; MERGE = 0 reads its count back with one acquire-release atomic."""
    r = lower_modes(M, N, K)
    # the table's merge (MODE 0) is 1 up to tuning.SPLIT_MERGE_MAX_NK and 0 above: 4096^2 and 28672x8192 one each
    assert r[0]["merge"] == (1 if N * K <= (1 << 26) else 0) and r["merge_other"]["merge"] == 1 - r[0]["merge"]
    zero, one = (r[0]["ptx"], r["merge_other"]["ptx"])[::1 if r[0]["merge"] == 0 else -1]
    assert r["merge_other"]["mma"] == r[0]["mma"] and r["merge_other"]["spilled"] == 0 == r[0]["spilled"]
    wide = _wide_loads(r)
    assert wide["merge_other"] == wide[0]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.global\.acq_rel\.gpu\.add", zero), "MERGE 0's counter"
    assert not re.search(r"acq_rel\.add", one)                          # no count read back by the publishers
    assert re.search(r"(atom|red)\.global\.(gpu\.release|release\.gpu)\.add", one)
    polls = r"(atom\.global\.(gpu\.acquire|acquire\.gpu)\.add|ld\.global\.(gpu\.acquire|acquire\.gpu))"
    assert len(re.findall(polls, one)) >= 2                             # the first poll and the loop's
    assert not re.search(r"exch", one)                                 # the count goes back by subtraction
    assert len(re.findall(r"(atom|red)\.global\.(gpu\.release|release\.gpu)\.add", one)) >= 2   # count + reset
