"""The sweep that writes the cuda backend's GEMV table (``benchmarks/gemv_table_sweep.py``) off the GPU: every variant
it would time holds whole groups per slice and fits shared memory, its options are checked, and ptxas' report is
read from the log or the cubin. The kernel's values are checked on the CPU by ``tests/test_cuda_backend.py`` (its
CUDA C run through ``host_run``) and on the hardware by ``gemv_table_sweep.py --phase check`` (every variant,
NaN-poisoned outputs) before anything is timed; ``write-table`` is tested there too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gemv_table_sweep as gemv_wide  # noqa: E402


@pytest.mark.parametrize("M", [1, 4])
def test_variants_hold_whole_groups_and_fit(M):
    for bits, N, K in gemv_wide.shapes_for(M):
        vs = gemv_wide.variants(bits, N, K, M)
        assert vs, (bits, N, K)
        for quads, lanes, s, pf, ldna in vs:
            assert K % (128 * s) == 0 and N % (4 * quads) == 0
            assert (128 // (32 // bits)) % lanes == 0          # row lanes divide a group's word rows
            assert K // 128 // s >= pf
            assert gemv_wide.smem_bytes(bits, K, quads, lanes, s, M) <= 100 * 1024


def test_deep_rings_only_where_the_ramp_rules_and_within_the_register_budget():
    # PF 4 / 8 (a slice's every group before the PDL wait) on the N <= 6144 shapes only, never more than
    # MAX_RING_ROWS 16-byte word rows in flight per thread; every other shape keeps PF 1 / 2
    seen = set()
    for bits, N, K in gemv_wide.shapes_for(1):
        for quads, lanes, s, pf, ldna in gemv_wide.variants(bits, N, K, 1):
            if pf > 2:
                assert N <= gemv_wide.DEEP_MAX_N
                assert (128 * bits // 32 // lanes) * pf <= gemv_wide.MAX_RING_ROWS
                seen.add((N, K, pf))
    assert {(4096, 4096, 4), (4096, 4096, 8), (6144, 4096, 4), (4096, 14336, 8)} <= seen
    assert not any(N > gemv_wide.DEEP_MAX_N for N, _, _ in seen)


def test_deep_max_n_widens_the_deep_rings_to_the_large_shapes():
    # --deep-max-n 1000000 (an H200 sweep: more bytes in flight per SM at a higher bandwidth) adds PF 4 / 8 to the
    # large shapes, within the same register budget, and keeps every variant the default sweep had
    default = {s: set(gemv_wide.variants(*s)) for s in gemv_wide.shapes_for(1)}
    widened = {s: set(gemv_wide.variants(*s, deep_max_n=1_000_000)) for s in gemv_wide.shapes_for(1)}
    for s in default:
        assert default[s] <= widened[s]
    new = {(s, v[3]) for s in widened for v in widened[s] - default[s]}
    assert all(s[1] > 6144 and pf > 2 for s, pf in new)
    assert ((4, 28672, 8192), 4) in new and ((4, 16384, 16384), 8) in new


def test_deep_max_n_rejects_a_non_positive_count(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gemv_table_sweep.py", "--phase", "lower", "--deep-max-n", "0"])
    with pytest.raises(SystemExit, match=r"--deep-max-n 0: must be a positive column count"):
        gemv_wide.main()


def test_registers_reads_ptxas_report():
    log = ("ptxas info    : Used 64 registers, used 1 barriers, 16 bytes smem\n"
           "ptxas info    : 8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads")
    assert gemv_wide.registers(log) == {"registers": 64, "spill_stores": 4, "spill_loads": 12, "smem": 16}
    assert gemv_wide.registers("") == {"registers": None, "spill_stores": None, "spill_loads": None, "smem": None}


def test_help_names_every_phase():
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "gemv_table_sweep.py"
    out = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True, check=True).stdout
    for phase in ("lower", "check", "bench", "write-table"):
        assert phase in out


def test_a_variant_answered_from_the_compute_cache_reports_its_cubins_registers():
    # on a warm GPU machine NVRTC may answer from the driver's compute cache with no ptxas report in the log: the
    # sweep's row then carries the registers and stack frame the cubin records, marked from_cubin
    import dataclasses

    pytest.importorskip("cuda.bindings")
    compiled = _uncached_compile((1, 4, 4096, 4096, (16, 4, 8, 2, 1)))
    log = compiled.log
    fresh = gemv_wide.report(compiled, log)
    hit = gemv_wide.report(dataclasses.replace(compiled, log=""), "")
    assert "from_cubin" not in fresh and fresh["registers"] > 0
    assert hit["from_cubin"] and hit["registers"] == fresh["registers"] and hit["frame_bytes"] == 0


def _uncached_compile(job):
    """The variant's kernel compiled from a source text no earlier compile used (a unique trailing comment), so that
    on a GPU machine NVRTC cannot answer from the driver's compute cache and its log holds ptxas' report."""
    import uuid

    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda import quant_gemv as C

    M, bits, N, K, v = job
    op, cfg = gemv_wide._op_cfg(M, bits, N, K, v)
    text = nvrtc.source(C.SOURCE) + f"\n// {uuid.uuid4()}\n"
    return nvrtc.compile_text(text, C.SOURCE, tuple(C.defines(op, cfg, True, None).items()), "sm_90a")
