"""Ctrl-C in the middle of ``portakern conformance``: SIGINT sent to the process after its first progress line.

The report is valid JSON that says it was interrupted, holds every record made (the cases done, in the serial order
for a serial run) and the exit status is 130; the Markdown and JUnit outputs are written too and the journal of a
serial run is removed. An impatient user's further Ctrl-C presses, arriving while the report is built and written,
do not cut it short.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from fault_helpers import ROOT, child_env


def _start(tmp_path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "portakern", "conformance", "--backend", "cpu", "--device", "cpu",
           "--report", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"),
           "--junit", str(tmp_path / "r.xml"), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _first_progress_line(p: subprocess.Popen) -> str:
    line = p.stderr.readline()
    assert line.startswith("conformance: "), (line, p.communicate())
    return line


def _check_report(tmp_path, out: str, err: str, serial: bool) -> dict:
    rep = json.loads((tmp_path / "r.json").read_text())
    made = rep["interrupted"]["records"]
    assert rep["exit_status"] == 130 and 0 < made < rep["interrupted"]["expected"]
    assert len(rep["results"]) == made and all(r["status"] == "pass" for r in rep["results"])
    assert f"interrupted after {made} of {rep['interrupted']['expected']} records" in err
    assert f"{made} records, exit status 130 (interrupted: {made} of" in out
    from portakern.conformance.selection import selected_cases

    order = [c.id for c in selected_cases("cpu", None)]
    ids = [r["case"] for r in rep["results"]]
    assert len(set(ids)) == len(ids) and set(ids) <= set(order)
    if serial:
        assert ids == order[:made]                                  # the cases done, in order
        assert not (tmp_path / "r.json.partial.jsonl").exists()     # the report holds every record now
    assert f"INTERRUPTED (Ctrl-C) after {made} of" in (tmp_path / "r.md").read_text()
    ET.parse(tmp_path / "r.xml")
    return rep


@pytest.mark.subprocess
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sigint_after_the_first_progress_line_leaves_a_valid_report_and_exit_130(tmp_path, jobs):
    p = _start(tmp_path, "--jobs", jobs)
    try:
        _first_progress_line(p)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    _check_report(tmp_path, out, err, serial=jobs == "1")


@pytest.mark.subprocess
def test_repeated_sigint_while_the_report_is_written_does_not_cut_it_short(tmp_path):
    """Ctrl-C pressed again and again: every SIGINT after the first lands while the run stops and writes."""
    p = _start(tmp_path)
    try:
        _first_progress_line(p)
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            p.send_signal(signal.SIGINT)
            time.sleep(0.005)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    # 130, or death by the SIGINT that Python re-raises when one lands during interpreter shutdown (after the
    # report is written): a shell reads both as 130
    assert p.returncode in (130, -signal.SIGINT), err[-2000:]
    assert "before any case ran" not in err                        # the CLI does not deny the report it wrote
    _check_report(tmp_path, out, err, serial=True)


@pytest.fixture
def sigint_raises():
    """SIGINT raising KeyboardInterrupt in this process, as under a terminal, also where the launcher ignores it
    (``nohup``, a background job of a non-interactive shell: Python then keeps SIGINT ignored); restored after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_an_interrupted_run_in_process_gives_the_sigint_handler_back(register_plugin, tmp_path, sigint_raises):
    """run() absorbs Ctrl-C only while it stops and writes: the caller's handler is in place again after."""
    from portakern.backends.cpu.backend import CpuBackend
    from portakern.conformance.runner import run
    from plugin_helpers import provides

    class StopsOnSecondRun(CpuBackend):
        name, priority, runs = "ctrl-c-second", -100, 0

        def compile(self, op, device):
            inner = super().compile(op, device)

            def kernel(*args):
                type(self).runs += 1
                if type(self).runs == 2:
                    raise KeyboardInterrupt
                inner(*args)
            return kernel

    register_plugin(provides(StopsOnSecondRun()), name="ctrl-c-second")
    before = signal.getsignal(signal.SIGINT)
    report, code = run(backends=["ctrl-c-second"], cases_glob="gemv-q8_0-g32-m1-*,gemv-q4_0-g32-m1-*",
                       report=tmp_path / "r.json", progress=False, out=None)
    assert code == 130 and report["interrupted"]["records"] >= 1
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):     # Ctrl-C raises again as it did before the run
        signal.raise_signal(signal.SIGINT)
