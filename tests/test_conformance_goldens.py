"""Goldens: the stored manifest matches the data and the tier, the reference reproduces every golden, the GEMV
goldens agree with the generated codes without the packers, and a golden is never silently replaced (a missing
or corrupt one is an error, not a comparison of the reference with itself; forced regeneration never carries a
corrupt one into a new manifest)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from portakern.conformance import goldens as G
from portakern.conformance.cases import all_cases, select
from portakern.conformance.runner import run

CPU_CASES = all_cases("cpu")


# -- goldens -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store():
    return G.Store()


def test_manifest_matches_the_data_and_the_tier(store):
    assert store.verify_sha() == []
    assert set(store.cases) == {c.id for c in CPU_CASES}
    assert store.manifest["suite"] == "cases-v3"
    size = (store.directory / G.DATA_FILE).stat().st_size
    assert size < 12e6, f"goldens grew to {size / 1e6:.1f} MB"


def test_reference_reproduces_every_golden(store):
    assert G.verify(CPU_CASES, store) == []


def test_gemv_goldens_agree_with_the_generated_codes_without_the_packers(store):
    """gold = x @ ((codes - zero) * scale)^T from the generator: the packers and the reference agree (x for the
    silu_mul cases: gate / (1 + exp(-gate)) * up, written out here)."""
    for c in [c for c in CPU_CASES if c.kind == "quant_gemv"]:
        inp = c.inputs()
        x = inp["x"].astype(np.float64)
        if c.prologue == "silu_mul":
            x = x[:, :c.K] / (1.0 + np.exp(-x[:, :c.K])) * x[:, c.K:]
        want = x @ c.dequantized(inp).T
        got = store.get(c.id).out
        with np.errstate(invalid="ignore"):      # the nf-* cases' NaN inputs
            assert np.allclose(got, want, rtol=2.0 ** -11, atol=1e-5, equal_nan=True), c.id


# -- goldens are never silently replaced -------------------------------------------------------------

ONE = "gemv-q8_0-g32-m1-n77-k352-fp32"
OTHER = "gemv-awq-g32-m1-n72-k352-bf16"


@pytest.fixture
def one_golden(tmp_path, monkeypatch):
    """A golden directory holding the golden of ``ONE`` only (the on-the-fly cache is private)."""
    monkeypatch.setattr(G, "_CACHE_DIR", tmp_path / "cache")
    d = tmp_path / "goldens"
    assert G.regenerate(select(all_cases(), ONE), d, force=True, out=open(os.devnull, "w")) == 0
    return d


def test_a_golden_directory_without_a_manifest_is_a_usage_error(tmp_path, capsys):
    from portakern.conformance import cli_main
    from portakern.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"golden_dir='.*' \(--goldens\) holds no manifest.json"):
        run(backends=["cpu"], cases_glob=ONE, golden_dir=tmp_path, progress=False, out=None)
    assert cli_main(["--backend", "cpu", "--cases", ONE, "--goldens", str(tmp_path), "--no-progress"]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err


def test_a_cpu_tier_case_missing_from_the_goldens_errors_instead_of_comparing_the_reference_with_itself(one_golden):
    report, code = run(backends=["cpu"], cases_glob=f"{ONE},{OTHER}", golden_dir=one_golden, progress=False, out=None)
    by = {r["case"]: r for r in report["results"]}
    assert by[ONE]["status"] == "pass"
    assert by[OTHER]["status"] == "error" and code == 1
    assert f"{OTHER} is a cpu-tier case but" in by[OTHER]["reason"] and "has no golden for it" in by[OTHER]["reason"]
    assert "portakern goldens --force" in by[OTHER]["reason"]


def test_stored_gold_bytes_that_differ_from_the_manifest_error_instead_of_judging_the_backend(one_golden):
    import zipfile

    z = one_golden / G.DATA_FILE
    with zipfile.ZipFile(z) as f:
        members = {n: f.read(n) for n in f.namelist()}
    gold = G._decode(members[f"{ONE}.out"], (1, 77))
    members[f"{ONE}.out"] = G._encode(np.zeros_like(gold))      # the data file of another version
    with zipfile.ZipFile(z, "w") as f:
        for n, b in members.items():
            f.writestr(n, b)
    report, code = run(backends=["cpu"], cases_glob=ONE, golden_dir=one_golden, progress=False, out=None)
    rec = report["results"][0]
    assert rec["status"] == "error" and code == 1
    assert "does not match out_sha256" in rec["reason"] and "portakern goldens --force" in rec["reason"]


def test_goldens_check_of_a_directory_without_goldens_is_a_usage_error(tmp_path, capsys):
    from portakern.conformance import goldens_main

    assert goldens_main(["--check", "--dir", str(tmp_path), "--cases", ONE]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err


def test_forced_regeneration_of_other_cases_never_carries_a_corrupt_golden_into_a_new_manifest(one_golden, capsys):
    m = json.loads((one_golden / G.MANIFEST).read_text())
    m["cases"][ONE]["out_sha256"] = "0" * 64
    (one_golden / G.MANIFEST).write_text(json.dumps(m))
    assert G.regenerate(select(all_cases(), OTHER), one_golden, force=True) == 1
    assert "nothing written" in capsys.readouterr().out
    assert json.loads((one_golden / G.MANIFEST).read_text())["cases"][ONE]["out_sha256"] == "0" * 64
