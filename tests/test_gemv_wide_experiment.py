"""The CUDA C GEMV experiment (``benchmarks/experiments/gemv_wide.py`` / ``gemv_wide.cu``) off the GPU: its index
maps and arithmetic, loop for loop in numpy float32, against the float64 product of the unpacked codes; the
variant list it times. Its values on the hardware are checked by ``gemv_wide.py --phase check`` (every variant,
NaN-poisoned outputs) before anything is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from experiments import gemv_wide  # noqa: E402


@pytest.mark.parametrize("bits,N,K,quads,lanes,s", [
    (4, 256, 1024, 16, 2, 2), (4, 128, 2048, 32, 4, 4), (4, 128, 1024, 16, 8, 1),
    (8, 256, 1024, 16, 4, 2), (8, 128, 2048, 32, 16, 4),
])
def test_emulation_matches_float64(bits, N, K, quads, lanes, s):
    assert gemv_wide.emulate(bits, N, K, quads, lanes, s) < 1e-5


def test_emulation_sees_a_wrong_x_map(monkeypatch):
    # the staged x as if the 16-byte vector held one row's 8 positions (the int8 order) instead of 8 rows at one
    # position: the emulation must not pass it
    real = gemv_wide.emulate

    def wrong(bits, N, K, quads, lanes, s):
        src = Path(gemv_wide.__file__).read_text()
        bad = src.replace("xs[(blk * 8 + r) * epw + e] = xsl[i * 8 + r]", "xs[(blk * 8 + e) * epw + r] = xsl[i * 8 + r]")
        assert bad != src
        ns = dict(vars(gemv_wide))
        exec(compile(bad, gemv_wide.__file__, "exec"), ns)
        return ns["emulate"](bits, N, K, quads, lanes, s)

    assert real(4, 256, 1024, 16, 2, 2) < 1e-5
    assert wrong(4, 256, 1024, 16, 2, 2) > 1e-2


def test_variants_hold_whole_groups_and_fit():
    for bits, N, K in gemv_wide.SHAPES:
        vs = gemv_wide.variants(bits, N, K)
        assert vs, (bits, N, K)
        for quads, lanes, s, pf, ldna in vs:
            assert K % (128 * s) == 0 and N % (4 * quads) == 0
            assert (128 // (32 // bits)) % lanes == 0          # row lanes divide a group's word rows
            assert K // 128 // s >= pf
            assert gemv_wide.smem_bytes(bits, K, quads, lanes, s) <= 227 * 1024
