"""The conformance runner and its tools: exit codes, unsupported reasons, repeats, compile-only,
plugin cases, golden regeneration, the pytest plugin and the support matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from portakern.backends.cpu.backend import CpuBackend
from portakern.backend import YES, no
from portakern.conformance import cli_main, goldens_main
from portakern.conformance import goldens as G
from portakern.conformance.case import AttentionCase
from portakern.conformance.cases import all_cases, select
from portakern.conformance.runner import collect_cases, run
from portakern.plugins import hookimpl

REPO = Path(__file__).resolve().parent.parent


class Picky(CpuBackend):
    """Says no to odd head dims, with a reason."""

    name = "picky"

    def supports(self, op, device):
        if op.kind == "attention" and op.head_dim == 59:
            return no(f"picky: head_dim={op.head_dim} is not a multiple of 8; pad the head dimension")
        return super().supports(op, device)


class Flaky(CpuBackend):
    """Correct, but every other call differs from the last in one bit (within tolerance)."""

    name = "flaky"

    def compile(self, op, device):
        inner = super().compile(op, device)
        calls = [0]

        def kernel(*args):
            inner(*args)
            calls[0] += 1
            out = args[3] if op.kind == "attention" else args[2]
            if calls[0] % 2 == 0:
                out[...] = np.nextafter(out, np.float32(np.inf))

        return kernel


class Aot(CpuBackend):
    """Can lower for two targets without the device; fails on one op."""

    name = "aot"
    compile_targets = ("sm_100a", "gfx942")

    def supports(self, op, device):
        return YES

    def compile_for_target(self, op, target):
        if op.kind == "quant_gemv" and target == "gfx942":
            raise RuntimeError("no MFMA lowering for quant_gemv yet")
        return b"artifact"


PLUGIN_CASE = AttentionCase(id="plugin-attn-d40-sq9-sk33-causal-fp32", dtype="float32", B=2, Sq=9, Sk=33,
                            Hq=2, Hkv=1, D=40, causal=True, tags=("causal",))


class TestPlugin:
    @hookimpl
    def portakern_register_backends(self):
        return [Picky(), Flaky(), Aot()]

    @hookimpl
    def portakern_conformance_cases(self):
        return [PLUGIN_CASE]


@pytest.fixture
def plugin(register_plugin, monkeypatch, tmp_path):
    monkeypatch.setattr(G, "_CACHE_DIR", tmp_path / "cache")
    return register_plugin(TestPlugin(), name="conformance-test-plugin")


def _run(**kw):
    return run(device="cpu", progress=False, out=None, **kw)


# -- exit codes ----------------------------------------------------------------------------------

def test_exit_codes(capsys):
    assert cli_main(["--backend", "cpu", "--cases", "gemv-awq-g32-*", "--no-progress"]) == 0
    assert cli_main(["--backend", "nosuch", "--cases", "gemv-awq-g32-*"]) == 2
    assert "--backend nosuch: no backend of that name is registered" in capsys.readouterr().err
    assert cli_main(["--backend", "cpu", "--cases", "no-such-case-*"]) == 2
    assert cli_main(["--target", "sm_100a"]) == 2
    assert cli_main(["--compile-only"]) == 2
    assert cli_main(["--tier", "tpu"]) == 2
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--backend" in out and "--compile-only" in out and "exit status" in out
    assert cli_main(["--list", "--cases", "gemv-q8_0-*"]) == 0
    assert "gemv-q8_0-g32-m1-n77-k352-fp32" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(repeat=0), r"repeat=0 must be >= 1"),
    (dict(tier="tpu"), r"tier='tpu' is unknown: expected one of cpu, gpu"),
    (dict(cases_glob="no-such-case-*"), r"cases='no-such-case-\*' matches no case of cases-v3 tier cpu; list the "
                                        r"ids with: portakern conformance --list"),
    (dict(compile_only=True), r"--compile-only needs --target T1,T2 \(e.g. sm_100a,gfx942\)"),
], ids=["repeat", "tier", "no-case", "compile-only-without-target"])
def test_run_usage_errors_name_the_argument(kwargs, fragment):
    from portakern.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=fragment):
        run(backends=["cpu"], progress=False, out=None, **kwargs)


def test_unknown_case_id_names_the_way_to_list_them():
    from portakern.conformance.cases import by_id

    with pytest.raises(KeyError, match=r"no case 'attn-nope' in cases-v3 \(tier cpu\); list the ids with: "
                                       r"portakern conformance --list --tier cpu"):
        by_id("attn-nope", tier="cpu")


def test_failing_backend_exits_1_through_the_portakern_cli(register_plugin, tmp_path, capsys):
    from conformance_mutants import MutantPlugin
    from portakern.cli import main

    register_plugin(MutantPlugin(), name="conformance-mutants")
    path = tmp_path / "r.json"
    assert main(["conformance", "--backend", "mutant-awq-nibbles", "--cases", "gemv-awq-g32-m1-*",
                 "--report", str(path), "--no-progress"]) == 1
    rep = json.loads(path.read_text())
    assert rep["exit_status"] == 1 and rep["results"][0]["status"] == "fail"
    assert "gemv-awq-g32-m1-n72-k352-bf16" in capsys.readouterr().out


# -- statuses --------------------------------------------------------------------------------------

def test_unsupported_cases_are_reported_with_the_reason_never_dropped(plugin):
    cases = "attn-d59-*,attn-d64-sq24-sk300-*-causal-fp32"
    report, code = _run(backends=["picky"], cases_glob=cases)
    recs = report["results"]
    assert len(recs) == len(select(all_cases(), cases)) and code == 0
    uns = [r for r in recs if r["status"] == "unsupported"]
    assert uns and all(r["case"].startswith("attn-d59-") and "head_dim=59" in r["reason"] for r in uns)
    assert all(r["status"] == "pass" for r in recs if not r["case"].startswith("attn-d59-"))
    assert report["summary"]["picky"]["attention"]["unsupported"] == len(uns)


def test_repeat_flags_nondeterminism(plugin):
    report, code = _run(backends=["flaky", "cpu"], cases_glob="attn-d64-sq24-sk300-*-causal-fp32", repeat=3)
    by = {r["backend"]: r for r in report["results"]}
    assert by["flaky"]["status"] == "nondeterministic" and "bitwise" in by["flaky"]["reason"]
    assert by["cpu"]["status"] == "pass" and code == 1
    report, code = _run(backends=["flaky"], cases_glob="attn-d64-sq24-sk300-*-causal-fp32", repeat=1)
    assert code == 0


def test_compile_only(plugin):
    cases = "gemv-awq-g32-m1-*,attn-d64-sq24-sk300-*-causal-fp32"
    report, code = run(backends=["aot", "cpu"], cases_glob=cases, compile_only=True,
                       targets=["sm_100a,gfx942"], progress=False, out=None)
    recs = {(r["backend"], r["device"], r["op"]): r for r in report["results"]}
    assert report["mode"] == "compile-only" and report["targets"] == ["sm_100a", "gfx942"]
    assert recs[("aot", "sm_100a", "attention")]["status"] == "pass"
    assert recs[("aot", "sm_100a", "quant_gemv")]["status"] == "pass"
    assert recs[("aot", "gfx942", "attention")]["status"] == "pass"
    bad = recs[("aot", "gfx942", "quant_gemv")]
    assert bad["status"] == "fail" and "MFMA" in bad["reason"]
    assert recs[("cpu", "sm_100a", "attention")]["status"] == "unsupported"
    assert "compile_targets" in recs[("cpu", "gfx942", "quant_gemv")]["reason"]
    assert code == 1


def test_plugin_cases_run_against_goldens_computed_on_the_fly(plugin):
    assert PLUGIN_CASE.id in [c.id for c in collect_cases("cpu")]
    report, code = _run(backends=["cpu"], cases_glob="plugin-*")
    assert code == 0 and report["results"][0]["status"] == "pass"
    assert list((G._CACHE_DIR).rglob("plugin-attn-*.npz"))          # cached for the next run


def test_bf16_cases_run_on_a_numpy_backend_through_torch():
    pytest.importorskip("torch")
    report, code = _run(backends=["cpu"], cases_glob="attn-d32-sq48-sk48-*-window-bf16*")
    assert code == 0 and report["results"][0]["status"] == "pass"


# -- goldens ---------------------------------------------------------------------------------------

def test_regeneration_refuses_to_overwrite_without_force(tmp_path, capsys):
    cases = select(all_cases(), "gemv-q8_0-g32-m1-*,attn-d32-sq1-sk1-*")
    assert G.regenerate(cases, tmp_path, force=False) == 1
    assert not (tmp_path / G.MANIFEST).exists()
    assert "added" in capsys.readouterr().out
    assert G.regenerate(cases, tmp_path, force=True) == 0 and (tmp_path / G.MANIFEST).exists()
    assert G.regenerate(cases, tmp_path, force=False) == 0
    assert "up to date" in capsys.readouterr().out
    m = json.loads((tmp_path / G.MANIFEST).read_text())
    cid = cases[0].id
    m["cases"][cid]["out_sha256"] = "0" * 64
    m["cases"]["gone-case"] = m["cases"][cid]
    (tmp_path / G.MANIFEST).write_text(json.dumps(m))
    before = (tmp_path / G.MANIFEST).read_text()
    assert G.regenerate(cases, tmp_path, force=False) == 1
    out = capsys.readouterr().out
    assert f"changed  {cid}" in out and "removed  gone-case" in out and "refusing" in out
    assert (tmp_path / G.MANIFEST).read_text() == before
    assert goldens_main(["--check", "--dir", str(tmp_path), "--cases", cid]) == 1    # sha mismatch
    assert goldens_main(["--force", "--dir", str(tmp_path), "--cases", "gemv-q8_0-g32-m1-*,attn-d32-sq1-sk1-*"]) == 0
    assert goldens_main(["--check", "--dir", str(tmp_path), "--cases", "gemv-q8_0-g32-m1-*,attn-d32-sq1-sk1-*"]) == 0


def test_goldens_module_entry_point_refuses_without_force():
    r = subprocess.run([sys.executable, "-m", "portakern.conformance.goldens", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--force" in r.stdout


# -- pytest plugin ---------------------------------------------------------------------------------

def _pytest(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=env)


def test_pytest_plugin_collects_one_item_per_case(tmp_path):
    r = _pytest(tmp_path, "--portakern-backend", "cpu", "--portakern-cases", "gemv-awq-g32-*",
                "--junitxml", str(tmp_path / "j.xml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 passed" in r.stdout
    assert "gemv-awq-g32-m1-n72-k352-bf16[cpu]" in (tmp_path / "j.xml").read_text()
    r = _pytest(tmp_path, "--portakern-backend", "triton", "--portakern-cases", "gemv-awq-g32-m1-*", "-rs")
    assert "1 skipped" in r.stdout and "unsupported" in r.stdout


def test_pytest_plugin_does_nothing_without_its_option(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    r = _pytest(tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout
    r = _pytest(tmp_path, "--collect-only")
    assert "conformance" not in r.stdout


# -- support matrix --------------------------------------------------------------------------------

def test_support_matrix_in_docs_is_up_to_date():
    pytest.importorskip("torch", reason="the triton column needs torch")
    pytest.importorskip("triton", reason="the triton column needs triton")
    from portakern.conformance.support import generate_markdown

    text = generate_markdown()
    path = REPO / "docs" / "support.md"
    assert path.read_text() == text, ("docs/support.md is stale: regenerate with "
                                      "`portakern support --markdown --output docs/support.md`")


def test_git_info_prefers_the_commit_the_caller_names(monkeypatch):
    """A copied tree may carry a stale .git: PK_COMMIT, when set, is the commit the report names."""
    from portakern.conformance import report

    monkeypatch.setenv("PK_COMMIT", "0123abc")
    assert report.git_info() == {"commit": "0123abc", "dirty": None, "from": "PK_COMMIT"}
    monkeypatch.delenv("PK_COMMIT")
    info = report.git_info()
    assert info is None or (len(info["commit"]) == 40 and info["dirty"] in (True, False))


def _record_and_golden(kind="quant_gemv", dtype="float32"):
    from types import SimpleNamespace

    from portakern.conformance.report import Record

    gold = G.Golden("c", "", np.linspace(-1.0, 1.0, 64).reshape(2, 32), None, 1e-6, 1e-12)
    rec = Record(case="c", op=kind, dtype=dtype, backend="b", device="cpu", status="error")
    return rec, SimpleNamespace(id="c", kind=kind, dtype=dtype), gold


def test_judge_reports_the_largest_error_over_passing_repeats():
    from portakern.conformance.execute import judge

    rec, case, gold = _record_and_golden()
    small, large = gold.out.copy(), gold.out.copy()
    small[0, 0] += 1e-7
    large[1, 3] += 6e-7                       # within the bound (2 * 1e-6 + 1e-6 + 4e-6), but the larger error
    rec = judge(rec, case, gold, [(small, None), (large, None), (small, None)])
    assert rec.status == "nondeterministic"   # repeats differ; the margin is still the worst repeat's
    assert rec.max_abs_err == pytest.approx(6e-7, rel=1e-3)
    assert rec.extra["nmse"] > 1e-15


def test_an_exception_while_judging_is_the_case_s_error_record_not_the_end_of_the_run(monkeypatch):
    from portakern.conformance import execute

    rec, case, gold = _record_and_golden()
    monkeypatch.setattr(execute.T, "rule", lambda op, dtype: (_ for _ in ()).throw(KeyError((op, dtype))))
    monkeypatch.setattr(execute, "place", lambda *a: {"x": np.zeros((2, 8), np.float32)})
    monkeypatch.setattr(execute, "weight_for", lambda *a: None)
    monkeypatch.setattr(execute, "build_op", lambda *a: None)
    monkeypatch.setattr(execute, "supports", lambda *a: YES)
    monkeypatch.setattr(execute, "_call", lambda *a: (gold.out.copy(), None))
    monkeypatch.setattr(execute, "_sync", lambda device: None)
    case.kind = "quant_gemv"
    out = execute.run_case(case, {}, gold, CpuBackend(), "cpu")
    assert out.status == "error" and "judging the outputs failed: KeyError" in out.reason


def test_a_cached_computed_golden_is_not_served_after_the_reference_changed(plugin, monkeypatch):
    computed = []
    real = G.compute
    monkeypatch.setattr(G, "compute", lambda case, **kw: computed.append(case.id) or real(case, **kw))
    monkeypatch.setattr(G, "_reference_fingerprint", lambda: "reference-v1")
    G.golden_for(PLUGIN_CASE, None)
    G.golden_for(PLUGIN_CASE, None)
    assert computed == [PLUGIN_CASE.id]                              # the second call is a cache hit
    monkeypatch.setattr(G, "_reference_fingerprint", lambda: "reference-v2")
    G.golden_for(PLUGIN_CASE, None)
    assert computed == [PLUGIN_CASE.id] * 2                          # a changed reference is a miss
    assert len(list(G._CACHE_DIR.rglob("plugin-attn-*.npz"))) == 2


def test_computing_a_golden_removes_temp_files_that_killed_writers_left(plugin, monkeypatch):
    import os
    import time

    from portakern import cache

    folder = G._CACHE_DIR / G.SUITE
    folder.mkdir(parents=True, exist_ok=True)
    old = time.time() - cache.STALE_TMP_S - 60
    killed = folder / "plugin-attn-x-0123456789ab.4242.tmp.npz"      # a writer killed before os.replace
    live = folder / "plugin-attn-y-0123456789ab.4343.tmp.npz"        # a writer still at work
    other = folder / "notes.npz"                                       # not a temp file
    for f in (killed, live, other):
        f.write_bytes(b"partial")
    os.utime(killed, (old, old))
    os.utime(other, (old, old))
    G.golden_for(PLUGIN_CASE, None)
    assert not killed.exists() and live.exists() and other.exists()
    assert not list(folder.glob(f"*.{os.getpid()}.tmp.npz"))           # its own temp file was renamed into place


def test_a_golden_that_cannot_be_written_leaves_no_partial_file(plugin, monkeypatch):
    import os

    monkeypatch.setattr(G.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    g = G.golden_for(PLUGIN_CASE, None)
    assert g.out is not None                                           # the golden is still served, uncached
    assert not list((G._CACHE_DIR / G.SUITE).glob("*.tmp.npz"))
    assert not list((G._CACHE_DIR / G.SUITE).glob("plugin-attn-*.npz"))


def test_the_reference_fingerprint_covers_the_modules_that_make_a_golden(monkeypatch):
    # the naive model and the IR's evaluator by module; the cpu reference through the registry (its backend's
    # source_fingerprint), never by the backend's module names
    from portakern.plugins import registry

    G._reference_fingerprint.cache_clear()
    before = G._reference_fingerprint()
    assert len(before) == 64
    assert {"portakern.conformance.naive", "portakern.ir.evaluate"} <= set(G._REFERENCE_MODULES)
    assert not any(m.startswith("portakern.backends") for m in G._REFERENCE_MODULES)
    cpu = registry().get("cpu")
    monkeypatch.setattr(type(cpu), "source_fingerprint", lambda self: "another cpu reference")
    G._reference_fingerprint.cache_clear()
    try:
        assert G._reference_fingerprint() != before                     # a changed reference is another key
    finally:
        monkeypatch.undo()
        G._reference_fingerprint.cache_clear()
    assert G._reference_fingerprint() == before
