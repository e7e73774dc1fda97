"""A serial conformance run with a report appends every record to ``<report>.partial.jsonl`` as it is made: a run
whose process dies (a kernel's segfault) keeps the records made before it; a run that ends writes the report and
removes the journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from portakern.conformance.runner import journal_path, run

CRASH_PLUGIN = """
    import ctypes

    from portakern.backends.cpu.backend import CpuBackend
    from portakern.plugins import hookimpl

    calls = []


    class Crash(CpuBackend):
        name = "journal-crash"

        def compile(self, op, device):
            inner = super().compile(op, device)

            def kernel(*args):
                calls.append(1)
                if len(calls) == 3:                 # the third case dies the way a faulting kernel does: a real
                    ctypes.string_at(0)             # invalid read (PoCL's handler ignores a SIGSEGV sent by kill)
                return inner(*args)

            return kernel


    @hookimpl
    def portakern_register_backends():
        return [Crash()]
"""


def test_a_serial_run_that_segfaults_keeps_the_records_made_before(tmp_path):
    (tmp_path / "pk_journal_crash.py").write_text(textwrap.dedent(CRASH_PLUGIN))
    env = dict(os.environ, PORTAKERN_PLUGINS="pk_journal_crash",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "portakern", "conformance", "--backend", "journal-crash", "--cases", "gemv-*m1-*",
           "--jobs", "1", "--no-progress", "--report", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])
    assert not path.exists()
    lines = journal_path(path).read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert len(recs) == 2 and all(r["backend"] == "journal-crash" and r["status"] == "pass" for r in recs), recs
    assert all(r["case"].startswith("gemv-") and "-m1-" in r["case"] for r in recs)


def test_a_run_that_ends_removes_its_journal(tmp_path):
    path = tmp_path / "r.json"
    report, code = run(backends=["cpu"], cases_glob="gemv-q8_0-g32-m1-*", report=path, progress=False, out=None)
    assert code == 0 and path.exists() and report["results"]
    assert not journal_path(path).exists()


def test_no_report_no_journal():
    assert journal_path(None) is None
    assert str(journal_path("/x/r.json")) == "/x/r.json.partial.jsonl"
