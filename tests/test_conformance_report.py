"""Conformance reports keep every result: non-finite figures are written as JSON, a failing LSE still writes the
report, report paths are checked before the run, and Ctrl-C (serial or parallel) keeps the records made so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from portakern.backends.cpu.backend import CpuBackend
from portakern.conformance import report as R
from portakern.conformance.cases import all_cases, select
from portakern.conformance.runner import run
from portakern.plugins import hookimpl

LSE_CASES = "attn-d32-sq1-sk1-h2g1-b3-none-fp16-lse,attn-d32-sq17-sk300-h2g1-b1-causal-fp32-lse"


class NanLse(CpuBackend):
    """The CPU reference, but every LSE it returns is NaN (its output is right)."""

    name = "nan-lse"
    priority = -100

    def compile(self, op, device):
        inner = super().compile(op, device)

        def kernel(*args):
            inner(*args)
            if op.kind == "attention" and args[4] is not None:
                args[4][...] = np.nan

        return kernel


class Interrupted(CpuBackend):
    """The CPU reference until its third call, which is "interrupted" (Ctrl-C)."""

    name = "ctrl-c"
    priority = -100
    calls = 0

    def compile(self, op, device):
        inner = super().compile(op, device)

        def kernel(*args):
            Interrupted.calls += 1
            if Interrupted.calls == 3:
                raise KeyboardInterrupt
            inner(*args)

        return kernel


class ReportPlugin:
    @hookimpl
    def portakern_register_backends(self):
        return [NanLse(), Interrupted()]


@pytest.fixture
def report_backends(register_plugin):
    """The backends above, registered for one test."""
    return register_plugin(ReportPlugin(), name="conformance-report-backends")


# -- non-finite figures in the report -------------------------------------------------------------

def test_a_non_finite_extra_figure_is_written_as_json(tmp_path):
    rec = R.Record("c", "attention", "float32", "b", "cpu", "fail", max_abs_err=0.0, tolerance=1.0,
                   extra={"lse_err": float("inf"), "nmse": float("nan"), "first_call_ms": 2.0})
    d = rec.to_json()
    assert d["lse_err"] == "inf" and d["nmse"] is None and d["first_call_ms"] == 2.0
    json.dumps(d, allow_nan=False)


def test_nan_lse_fails_and_the_report_is_still_written(report_backends, tmp_path):
    path = tmp_path / "r.json"
    report, code = run(backends=["nan-lse"], cases_glob=LSE_CASES, report=path, progress=False, out=None)
    assert code == 1
    results = json.loads(path.read_text())["results"]
    assert len(results) == 2
    assert all(r["status"] == "fail" and "lse" in r["reason"] and r["lse_err"] == "inf" for r in results)


# -- report paths are checked before the run --------------------------------------------------------

@pytest.mark.parametrize("arg, option", [("report", "--report"), ("markdown", "--markdown"), ("junit", "--junit")])
def test_a_report_path_in_a_missing_directory_is_refused_before_the_run(tmp_path, arg, option):
    from portakern.errors import InvalidInputError

    path = tmp_path / "no-such-dir" / "r.out"
    with pytest.raises(InvalidInputError, match=rf"{arg}=.*\({option}\): the directory .*no-such-dir does not "
                                                rf"exist; create it first \(mkdir -p "):
        run(backends=["cpu"], cases_glob="gemv-q8_0-g32-m1-*", progress=False, out=None, **{arg: path})


def test_a_report_path_that_is_a_directory_is_refused_by_the_cli(tmp_path, capsys):
    from portakern.conformance import cli_main

    assert cli_main(["--backend", "cpu", "--cases", "gemv-q8_0-g32-m1-*", "--no-progress",
                     "--report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "(--report) is a directory" in err and "conformance.json" in err


# -- Ctrl-C keeps what was made ---------------------------------------------------------------------

GEMV4 = "gemv-awq-g32-m1-*,gemv-q8_0-g32-m1-*,gemv-q4_0-g32-m1-*,gemv-gptq-g32-m1-*"


def test_ctrl_c_in_a_serial_run_writes_the_records_made_so_far(report_backends, tmp_path, monkeypatch):
    monkeypatch.setattr(Interrupted, "calls", 0)
    path, md = tmp_path / "r.json", tmp_path / "r.md"
    try:
        report, code = run(backends=["cpu", "ctrl-c"], cases_glob=GEMV4, report=path, markdown=md,
                           progress=False, out=None)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped run(): no report was written and every record made was lost")
    assert code == 130 == report["exit_status"]
    rep = json.loads(path.read_text())
    made = [(r["case"], r["backend"], r["status"]) for r in rep["results"]]
    # cases 1 and 2 on both backends, case 3 on cpu; its call on ctrl-c was interrupted
    assert len(made) == 5 and all(s == "pass" for _, _, s in made), made
    assert rep["interrupted"] == {"records": 5, "expected": 2 * len(select(all_cases(), GEMV4))}
    assert "INTERRUPTED (Ctrl-C) after 5 of" in md.read_text()


SLOW_PLUGIN = """
    import time

    from portakern.backends.cpu.backend import CpuBackend
    from portakern.plugins import hookimpl


    class Slow(CpuBackend):
        name = "slow"

        def compile(self, op, device):
            inner = super().compile(op, device)

            def kernel(*args):
                time.sleep(0.4)
                return inner(*args)

            return kernel


    @hookimpl
    def portakern_register_backends():
        return [Slow()]
"""


def test_ctrl_c_in_a_parallel_cli_run_exits_130_with_the_report(tmp_path):
    (tmp_path / "pk_slow.py").write_text(textwrap.dedent(SLOW_PLUGIN))
    env = dict(os.environ, PORTAKERN_PLUGINS="pk_slow",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "portakern", "conformance", "--backend", "slow", "--cases", "gemv-*m1-*",
           "--jobs", "2", "--report", str(path)]
    # SIGINT as a terminal leaves it, also where this test's launcher ignores it (nohup, a background job)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stderr.readline()          # the first progress line: records are arriving
        assert line.startswith("conformance: "), line + proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)     # what a terminal's Ctrl-C does: the whole group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    rep = json.loads(path.read_text())
    assert rep["exit_status"] == 130 and 0 < rep["interrupted"]["records"] < rep["interrupted"]["expected"]
    assert rep["results"] and all(r["status"] == "pass" for r in rep["results"])
    assert "interrupted" in out
