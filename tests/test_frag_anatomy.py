"""benchmarks/experiments/frag_anatomy.py: the frag kernel's measurement-only MODE removes exactly the part it names
and leaves the real kernel (MODE 0) as the backend compiles it (sm_90a lowering, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))

from test_triton_attention import parent_only  # noqa: E402  (tests/ is on sys.path)


@parent_only
@pytest.mark.parametrize("M, N, K", [(4, 4096, 4096), (16, 28672, 8192)])
def test_each_mode_removes_its_part_and_mode_0_is_the_backend_kernel(M, N, K):
    from frag_anatomy import MODES, lower_modes

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
    wide = {m: v["ptx"].count("ld.global.v4") + v["ptx"].count("ld.global.nc.v4") for m, v in r.items()}
    assert wide[MODES["no_x"]] < wide[0]                                # x's 16-byte tiles gone, the words stay
    assert wide[MODES["no_math"]] == wide[0] and wide[MODES["no_merge"]] == wide[0]
    assert all(v["spilled"] == 0 for v in r.values()), {m: v["spilled"] for m, v in r.items()}


@parent_only
@pytest.mark.parametrize("M, N, K", [(4, 4096, 4096), (16, 28672, 8192)])
def test_the_other_split_k_merge_lowers_with_the_same_loop_and_its_own_atomics(M, N, K):
    """MERGE = 1 (the grid's last slice merges): the chunk loop is untouched (same MMAs and wide loads), nothing
    spills, the publishing slices count with a release atomic, the merging slice polls with acquire atomics in a
    loop and resets the count; MERGE = 0 reads its count back with one acquire-release atomic."""
    import re

    from frag_anatomy import lower_modes

    r = lower_modes(M, N, K)
    # the table's merge (MODE 0) is 1 up to gemv_tuning.SPLIT_MERGE_MAX_NK and 0 above: 4096^2 and 28672x8192 one each
    assert r[0]["merge"] == (1 if N * K <= (1 << 26) else 0) and r["merge_other"]["merge"] == 1 - r[0]["merge"]
    zero, one = (r[0]["ptx"], r["merge_other"]["ptx"])[::1 if r[0]["merge"] == 0 else -1]
    assert r["merge_other"]["mma"] == r[0]["mma"] and r["merge_other"]["spilled"] == 0 == r[0]["spilled"]
    wide = {m: v["ptx"].count("ld.global.v4") + v["ptx"].count("ld.global.nc.v4") for m, v in r.items()}
    assert wide["merge_other"] == wide[0]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add|atom\.global\.acq_rel\.gpu\.add", zero), "MERGE 0's counter"
    assert not re.search(r"acq_rel\.add", one)                          # no count read back by the publishers
    assert re.search(r"(atom|red)\.global\.(gpu\.release|release\.gpu)\.add", one)
    polls = r"(atom\.global\.(gpu\.acquire|acquire\.gpu)\.add|ld\.global\.(gpu\.acquire|acquire\.gpu))"
    assert len(re.findall(polls, one)) >= 2                             # the first poll and the loop's
    assert not re.search(r"exch", one)                                 # the count goes back by subtraction
    assert len(re.findall(r"(atom|red)\.global\.(gpu\.release|release\.gpu)\.add", one)) >= 2   # count + reset
