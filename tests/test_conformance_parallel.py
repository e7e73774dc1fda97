"""``portakern conformance --jobs N``: the cases sharded over spawned worker processes give the same
records, progress and report as a serial run, and a worker that dies costs only its own cases."""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap

import pytest

from portakern.conformance import cli_main
from portakern.conformance import runner
from portakern.conformance.runner import run
from portakern.errors import InvalidInputError

#: 35 quant_gemv cases at M = 1 (every packing but the K-quants of cases-v3); the first with N == 65 is number 29 (q4_0)
GEMV = "gemv-native*-m1-*,gemv-awq-*m1-*,gemv-gptq-*m1-*,gemv-q4_0-*m1-*,gemv-q8_0-*m1-*"

PLUGIN = """
    import os

    from portakern.backends.cpu.backend import CpuBackend
    from portakern.backend import YES
    from portakern.plugins import hookimpl


    class Crashy(CpuBackend):
        '''The CPU reference, except that the first call with N == 65 kills the process.'''

        name = "crashy"

        def compile(self, op, device):
            inner = super().compile(op, device)

            def kernel(*args):
                if op.kind == "quant_gemv" and op.N == 65:
                    if os.environ.get("PK_TEST_CRASH") == "raise":
                        raise KeyboardInterrupt("crashy was interrupted on N=65")
                    os._exit(3)
                return inner(*args)

            return kernel


    class Aot2(CpuBackend):
        name = "aot2"
        compile_targets = ("sm_100a", "gfx942")

        def supports(self, op, device):
            return YES

        def compile_for_target(self, op, target):
            if op.N == 72 and target == "gfx942":
                raise RuntimeError("no MFMA lowering for N=72")
            return b"artifact"


    @hookimpl
    def portakern_register_backends():
        return [Crashy(), Aot2()]
"""


@pytest.fixture
def env_plugin(fresh_registry, monkeypatch, tmp_path):
    """The backends above, loaded through PORTAKERN_PLUGINS from a module on PYTHONPATH (so the
    spawned workers load them too)."""
    (tmp_path / "pk_parallel_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PORTAKERN_PLUGINS", "pk_parallel_plugin")
    fresh_registry.reset()
    yield fresh_registry
    sys.modules.pop("pk_parallel_plugin", None)


def _key(r: dict) -> tuple:
    return (r["case"], r["backend"], r["device"], r["status"], r["max_abs_err"], r["tolerance"], r.get("nmse"),
            r["reason"])


def _run(**kw):
    return run(device="cpu", progress=False, out=None, **kw)


def test_two_jobs_give_the_records_progress_and_table_of_one(tmp_path):
    out1, out2, err2 = io.StringIO(), io.StringIO(), io.StringIO()
    rep1, code1 = run(backends=["cpu"], cases_glob=GEMV, jobs=1, progress=False, out=out1,
                      report=tmp_path / "r1.json")
    rep2, code2 = run(backends=["cpu"], cases_glob=GEMV, jobs=2, stream=err2, out=out2,
                      report=tmp_path / "r2.json")
    assert code1 == code2 == 0 and len(rep1["results"]) == 35
    assert [_key(r) for r in rep2["results"]] == [_key(r) for r in rep1["results"]]
    assert json.loads((tmp_path / "r1.json").read_text())["jobs"] == 1
    assert json.loads((tmp_path / "r2.json").read_text())["jobs"] == 2
    assert out2.getvalue().replace("r2.json", "r1.json") == out1.getvalue()
    lines = err2.getvalue().splitlines()
    assert lines[-1].startswith("conformance: 35/35 (100%)") and len(lines) >= 5   # updated as shards report


def test_jobs_in_repeat_and_compile_only_modes(env_plugin):
    kw = dict(backends=["cpu"], cases_glob="gemv-awq-*m1-*,attn-d64-sq24-sk300-*-causal-fp32", repeat=2)
    one, _ = _run(jobs=1, **kw)
    three, _ = _run(jobs=3, **kw)
    assert [_key(r) for r in three["results"]] == [_key(r) for r in one["results"]]
    assert three["jobs"] == 3 and three["repeat"] == 2
    kw = dict(backends=["aot2", "cpu"], cases_glob=GEMV, compile_only=True, targets=["sm_100a,gfx942"])
    one, code1 = run(jobs=1, progress=False, out=None, **kw)
    two, code2 = run(jobs=2, progress=False, out=None, **kw)
    assert len(one["results"]) == 35 * 2 * 2 and code1 == code2 == 1
    strip = [{k: v for k, v in r.items() if k != "time_ms"} for r in one["results"]]
    assert [{k: v for k, v in r.items() if k != "time_ms"} for r in two["results"]] == strip
    assert two["mode"] == "compile-only" and two["jobs"] == 2


def test_a_dying_worker_costs_only_its_own_unfinished_cases(env_plugin, tmp_path, capsys):
    path = tmp_path / "r.json"
    code = cli_main(["--backend", "cpu,crashy", "--cases", GEMV, "--jobs", "2", "--no-progress",
                     "--report", str(path)])
    rep = json.loads(path.read_text())
    assert code == 1 and rep["exit_status"] == 1 and rep["jobs"] == 2
    recs = rep["results"]
    ids = [r["case"] for r in recs[::2]]
    assert [r["backend"] for r in recs] == ["cpu", "crashy"] * 35 and len(set(ids)) == 35
    bad = {(i, r["backend"]): r for i, r in enumerate(recs) if r["status"] != "pass"}
    # case 29 (shard 1) killed its worker on the crashy backend; its cpu record had arrived already.
    # Shard 1's later cases 31 and 33 never ran; shard 0 and shard 1's earlier cases are intact.
    assert set(bad) == {(59, "crashy"), (62, "cpu"), (63, "crashy"), (66, "cpu"), (67, "crashy")}
    assert all(r["status"] == "error" for r in bad.values())
    assert bad[(59, "crashy")]["reason"] == "worker process 1 of 2 died (exit status 3) while running this case"
    assert "-n65-" in ids[29]
    assert bad[(62, "cpu")]["reason"] == f"not run: worker process 1 of 2 died (exit status 3) while running {ids[29]}"
    assert "5 failing record(s)" in capsys.readouterr().out


def test_a_worker_exception_is_the_reason_of_its_lost_cases(env_plugin, monkeypatch):
    monkeypatch.setenv("PK_TEST_CRASH", "raise")        # reaches the workers through os.environ
    rep, code = _run(backends=["crashy"], cases_glob=GEMV, jobs=2)
    bad = [r for r in rep["results"] if r["status"] != "pass"]
    assert code == 1 and [r["case"] for r in bad] == [rep["results"][i]["case"] for i in (29, 31, 33)]
    assert "KeyboardInterrupt: crashy was interrupted on N=65" in bad[0]["reason"]
    assert "while running this case" in bad[0]["reason"] and "not run" in bad[1]["reason"]


def test_one_job_starts_no_process(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("jobs=1 must not start workers")

    monkeypatch.setattr(runner, "_run_parallel", boom)
    rep, code = _run(backends=["cpu"], cases_glob="gemv-awq-g32-m1-*", jobs=1)
    assert code == 0 and rep["jobs"] == 1
    rep, code = _run(backends=["cpu"], cases_glob="gemv-awq-g32-m1-*", jobs=4)   # 1 case: 1 job
    assert code == 0 and rep["jobs"] == 1


def test_jobs_usage_errors(register_plugin, capsys):
    from portakern.backends.cpu.backend import CpuBackend
    from portakern.plugins import hookimpl

    with pytest.raises(InvalidInputError, match=r"jobs=-1 must be >= 0 \(0 = one worker per CPU core\)"):
        _run(backends=["cpu"], cases_glob=GEMV, jobs=-1)
    assert cli_main(["--backend", "cpu", "--cases", GEMV, "--jobs", "-2"]) == 2

    class Local(CpuBackend):
        name = "local"

    class P:
        @hookimpl
        def portakern_register_backends(self):
            return [Local()]

    register_plugin(P(), name="local-plugin")
    with pytest.raises(InvalidInputError, match=r"jobs > 1: local were registered by hand in this process"):
        _run(backends=["local"], cases_glob=GEMV, jobs=2)
    assert _run(backends=["local"], cases_glob="gemv-awq-g32-m1-*", jobs=1)[1] == 0


def test_jobs_zero_means_one_per_core(monkeypatch):
    seen = []
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 3)
    monkeypatch.setattr(runner, "_run_parallel", lambda spec, cases, bes, jobs, prog: seen.append(jobs) or ([], False))
    rep, _ = _run(backends=["cpu"], cases_glob=GEMV, jobs=0)
    assert seen == [3] and rep["jobs"] == 3
