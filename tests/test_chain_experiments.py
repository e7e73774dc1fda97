"""The GEMV-chain experiments (``benchmarks/experiments/chain_kernels.py``, ``gemv_chain.py``, ``layer_chain.py``) off
the GPU: the completion count the phases wait on, the grid that must fit at once, and the sm_90a lowering of both
kernels. Their values are checked on the GPU (``gemv_chain.py --phase check``, ``decode_step.py --chain``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from test_triton_attention import parent_only  # noqa: E402  (tests/ is on sys.path)

#: (N, K) of the decode step's chain phases and the lm head
STEP_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]


def _finished_tiles(N: int, K: int, P: int, BN: int = 256) -> tuple[list[int], int]:
    """A model of one phase's programs (the stream kernel's segments, as ``chain_kernels._phase`` walks them),
    written from the kernel's rules: a segment is a program's units of one column tile; one that covers its tile
    stores it, any other publishes and arrives, and the arrival that finds ``c_last - c_first`` earlier ones
    (``_arrive_sum``'s count of the programs whose ranges meet the tile) finishes the tile. Returns how often each
    tile is finished, and the fewest units any program owns."""
    G = K // 128
    tiles = -(-N // BN)
    T = tiles * G
    arrivals = [0] * tiles
    finished = [0] * tiles
    fewest = T
    for pid in range(P):
        u0 = (pid * T) // P
        n = ((pid + 1) * T) // P - u0
        fewest = min(fewest, n)
        seg_start = u0
        for u in range(u0, u0 + n):
            t, g = divmod(u, G)
            if g == G - 1 or u == u0 + n - 1:
                if seg_start == t * G and u + 1 == (t + 1) * G:
                    finished[t] += 1
                else:
                    arrivals[t] += 1
                seg_start = u + 1
    for t in range(tiles):
        c_first = ((t * G + 1) * P - 1) // T
        c_last = ((t + 1) * G * P - 1) // T
        if arrivals[t]:
            # the last arrival sees arrivals - 1 earlier ones: it finishes iff that is c_last - c_first
            finished[t] += int(arrivals[t] - 1 == c_last - c_first)
    return finished, fewest


@pytest.mark.parametrize("N,K", STEP_SHAPES)
@pytest.mark.parametrize("P", [1, 7, 131, 132, 264, 512])
def test_every_tile_of_a_phase_is_finished_exactly_once(N, K, P):
    """The next phase waits for the phase's count of finished tiles to reach its tile count: each tile must be
    finished once (never twice, never not at all), for every grid the chain may use (capped at the units)."""
    units = -(-N // 256) * (K // 128)
    P = min(P, units)
    finished, fewest = _finished_tiles(N, K, P)
    assert finished == [1] * len(finished)
    assert fewest >= 1          # every program owns a unit of every phase: the chain's buffer reuse relies on it


def test_the_grid_is_capped_at_the_smallest_phase():
    """``LayerChain``'s grid: two programs per SM unless a phase has fewer units (then one per unit)."""
    from experiments.layer_chain import BN

    units = min(-(-N // BN) * (K // 128) for N, K in STEP_SHAPES)
    assert units == 512 and min(2 * 132, units) == 264


def _compiled(n_regs: int, shared: int):
    return SimpleNamespace(n_regs=n_regs, metadata=SimpleNamespace(shared=shared))


@pytest.mark.parametrize("regs,shared,fit", [(128, 13312, 2), (196, 13312, 1), (110, 22528, 2), (64, 13312, 4),
                                             (32, 13312, 8), (64, 120 * 1024, 1)])
def test_resident_per_sm_counts_registers_shared_memory_and_warps(regs, shared, fit):
    """Programs of 8 warps that fit on an H100/H200 SM at once: 64K registers (allocated per warp in 256s), 228
    KiB of shared memory (1 KiB reserved per block), 64 warps."""
    from experiments.gemv_chain import resident_per_sm

    assert resident_per_sm(_compiled(regs, shared)) == fit


def test_layer_constexprs_follow_the_stream_kernel_per_phase():
    """Each phase's groups and x slots are the stream kernel's for its shape and the grid; the norm sums one
    square per column tile of the hidden size; phase 3 is RoPE (qkv) or a plain store (lm head)."""
    from experiments.chain_kernels import EPI_ROPE, EPI_STORE
    from experiments.layer_chain import EPS, constexprs

    from portakern.backends.triton.gemv_stream import x_slots

    for shapes, epi in ((STEP_SHAPES[:4], EPI_ROPE), (STEP_SHAPES[:3] + STEP_SHAPES[4:], EPI_STORE)):
        c = constexprs(shapes, 264, 1, 0, epi)
        for j, (N, K) in enumerate(shapes):
            assert (c[f"G{j}"], (c[f"XS{j}"], c[f"BY{j}"])) == (K // 128, x_slots(K // 128, -(-N // 256) * (K // 128),
                                                                                    264))
        assert c["NSS"] == 16 and c["EPS"] == EPS and c["EPI3"] == epi and c["BN"] == 256
    assert constexprs(STEP_SHAPES[:3] + STEP_SHAPES[4:], 264, 1, 0, EPI_STORE)["BY3"] is False   # lm: 61 units


@parent_only
@pytest.mark.parametrize("which", ["gemv-chain", "layer-qkv", "layer-lm"])
def test_chain_kernels_lower_for_sm90a_with_two_programs_per_sm(which):
    """Both kernels, specialised as a launch would (aligned pointers, strides divisible by 16), lower for sm_90a
    at 8 warps within 128 registers and no spills at one unit ahead (two programs per SM: the grid must be
    resident at once), with 16-byte word loads, the PDL wait of phase 0 only, the acquire spin of the others,
    finished tiles counted with release, and x read past L1 (``ld.global.cg``)."""
    import re

    from experiments import chain_kernels as CK
    from experiments.chain_lowering import lower_sm90, ptxas_registers, step_ints
    from experiments.layer_chain import constexprs

    if which == "gemv-chain":
        kernel, shapes, epi, ints = CK.gemv_chain_kernel, STEP_SHAPES[:4], CK.EPI_STORE, step_ints(STEP_SHAPES[:4], 32)
    else:
        kernel = CK.layer_chain_kernel
        shapes = STEP_SHAPES[:4] if which == "layer-qkv" else STEP_SHAPES[:3] + STEP_SHAPES[4:]
        epi = CK.EPI_ROPE if which == "layer-qkv" else CK.EPI_STORE
        ints = step_ints(shapes)
    ck = lower_sm90(kernel, constexprs(shapes, 264, 1, 0, epi), ints, maxnreg=128)
    ptx = ck.asm["ptx"]
    regs, spilled = ptxas_registers(ptx)
    assert regs is not None and regs <= 128 and spilled == 0, (regs, spilled)
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) >= 4 * 16     # the words, 16 bytes a load
    assert ptx.count("griddepcontrol.wait") == 1
    assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)               # the spin on the previous phase
    assert re.search(r"(red|atom)\.global\.gpu\.release\.add", ptx)         # a finished tile counted
    assert "ld.global.cg" in ptx and ".reqntid 256" in ptx
    assert ck.metadata.shared <= 99 * 1024


@pytest.mark.parametrize("spec,want", [("1,2,0", (1, 2, 0)), ("2,1,8", (2, 1, 8)), ("1,3,0", None), ("0,2,0", None),
                                       ("1,2", None), ("1,2,x", None), ("1,2,9", None)])
def test_chain_option_takes_three_small_numbers_and_says_which(spec, want):
    """``decode_step.py --chain``: a bad configuration is refused by the parser, naming the rule and an example."""
    import argparse

    from step_variants import chain_spec

    if want is not None:
        assert chain_spec(spec) == want
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"AHEAD 1 or 2, PER_SM 1 or 2 and L2_AHEAD 0 to 8, e\.g\. "
                                                             r"1,2,0") as e:
            chain_spec(spec)
        assert repr(spec) in str(e.value)
