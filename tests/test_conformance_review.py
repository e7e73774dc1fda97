"""Defects found reviewing the conformance tools: each test failed before its fix.

Reports keep every result (non-finite figures, Ctrl-C, unwritable paths), goldens cannot be
silently replaced by the backend under test, and runs that check nothing do not pass.
"""

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

    name = "review-nan-lse"
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

    name = "review-ctrl-c"
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


class ReviewPlugin:
    @hookimpl
    def portakern_register_backends(self):
        return [NanLse(), Interrupted()]


@pytest.fixture
def review_backends(register_plugin):
    """The backends above, registered for one test."""
    return register_plugin(ReviewPlugin(), name="conformance-review")


# -- non-finite figures in the report -------------------------------------------------------------

def test_a_non_finite_extra_figure_is_written_as_json(tmp_path):
    rec = R.Record("c", "attention", "float32", "b", "cpu", "fail", max_abs_err=0.0, tolerance=1.0,
                   extra={"lse_err": float("inf"), "nmse": float("nan"), "first_call_ms": 2.0})
    d = rec.to_json()
    assert d["lse_err"] == "inf" and d["nmse"] is None and d["first_call_ms"] == 2.0
    json.dumps(d, allow_nan=False)


def test_nan_lse_fails_and_the_report_is_still_written(review_backends, tmp_path):
    path = tmp_path / "r.json"
    report, code = run(backends=["review-nan-lse"], cases_glob=LSE_CASES, report=path, progress=False, out=None)
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


def test_ctrl_c_in_a_serial_run_writes_the_records_made_so_far(review_backends, tmp_path, monkeypatch):
    monkeypatch.setattr(Interrupted, "calls", 0)
    path, md = tmp_path / "r.json", tmp_path / "r.md"
    try:
        report, code = run(backends=["cpu", "review-ctrl-c"], cases_glob=GEMV4, report=path, markdown=md,
                           progress=False, out=None)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped run(): no report was written and every record made was lost")
    assert code == 130 == report["exit_status"]
    rep = json.loads(path.read_text())
    made = [(r["case"], r["backend"], r["status"]) for r in rep["results"]]
    # cases 1 and 2 on both backends, case 3 on cpu; its call on review-ctrl-c was interrupted
    assert len(made) == 5 and all(s == "pass" for _, _, s in made), made
    assert rep["interrupted"] == {"records": 5, "expected": 2 * len(select(all_cases(), GEMV4))}
    assert "INTERRUPTED (Ctrl-C) after 5 of" in md.read_text()


SLOW_PLUGIN = """
    import time

    from portakern.backends.cpu.backend import CpuBackend
    from portakern.plugins import hookimpl


    class Slow(CpuBackend):
        name = "review-slow"

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
    (tmp_path / "pk_review_slow.py").write_text(textwrap.dedent(SLOW_PLUGIN))
    env = dict(os.environ, PORTAKERN_PLUGINS="pk_review_slow",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "portakern", "conformance", "--backend", "review-slow", "--cases", "gemv-*m1-*",
           "--jobs", "2", "--report", str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
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


# -- goldens are never silently replaced -------------------------------------------------------------

ONE = "gemv-q8_0-g32-m1-n77-k352-fp32"
OTHER = "gemv-awq-g32-m1-n72-k352-bf16"


@pytest.fixture
def one_golden(tmp_path, monkeypatch):
    """A golden directory holding the golden of ``ONE`` only (the on-the-fly cache is private)."""
    from portakern.conformance import goldens as G

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

    from portakern.conformance import goldens as G

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
    from portakern.conformance import goldens as G

    m = json.loads((one_golden / G.MANIFEST).read_text())
    m["cases"][ONE]["out_sha256"] = "0" * 64
    (one_golden / G.MANIFEST).write_text(json.dumps(m))
    assert G.regenerate(select(all_cases(), OTHER), one_golden, force=True) == 1
    assert "nothing written" in capsys.readouterr().out
    assert json.loads((one_golden / G.MANIFEST).read_text())["cases"][ONE]["out_sha256"] == "0" * 64


# -- a run that checks nothing does not pass --------------------------------------------------------

class Declines(CpuBackend):
    """Says no to everything, with a reason."""

    name = "review-declines"
    priority = -100

    def supports(self, op, device):
        from portakern.backend import no

        return no("review-declines: this build has no kernels for this device")


def test_a_run_where_every_record_is_unsupported_exits_1(register_plugin, tmp_path, capsys):
    from portakern.conformance import cli_main

    class P:
        @hookimpl
        def portakern_register_backends(self):
            return [Declines()]

    register_plugin(P(), name="review-declines")
    md = tmp_path / "r.md"
    assert cli_main(["--backend", "review-declines", "--cases", "gemv-q8_0-*", "--no-progress",
                     "--markdown", str(md)]) == 1
    assert "nothing ran: all 8 record(s) are unsupported" in capsys.readouterr().out
    assert "result: FAIL: nothing ran" in md.read_text()
    # one backend that ran is enough: the other's unsupported records are not failures
    assert cli_main(["--backend", "review-declines,cpu", "--cases", "gemv-q8_0-*", "--no-progress"]) == 0


# -- scripts/main.sh ----------------------------------------------------------------------------------

FAKE_PORTAKERN = """
class _D:
    def __init__(self, type, index, info=()):
        self.type, self.index, self.info = type, index, info

    def __str__(self):
        return self.type if self.type == "cpu" else f"{self.type}:{self.index}"


def devices():
    {body}
"""


def _main_sh_sandbox(tmp_path, devices_body: str):
    """Run a copy of scripts/main.sh beside a no-op setup.sh and a stub .venv: its ``python`` is this
    interpreter importing a fake ``portakern`` whose ``devices()`` runs ``devices_body``, and its
    ``portakern`` logs its arguments. Returns the completed process and the conformance calls."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "main.sh").write_text((repo / "scripts" / "main.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("true\n")
    (tmp_path / "fake" / "portakern").mkdir(parents=True)
    (tmp_path / "fake" / "portakern" / "__init__.py").write_text(FAKE_PORTAKERN.replace("{body}", devices_body))
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(f'#!/usr/bin/env bash\nPYTHONPATH={tmp_path}/fake exec {sys.executable} "$@"\n')
    (bin_ / "portakern").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/calls\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "main.sh")], capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return r, [c for c in calls if c.startswith("conformance")]


def test_main_sh_runs_the_suite_on_rocm_devices_too(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('rocm', 0), _D('opencl', 0)]")
    assert r.returncode == 0, r.stderr
    assert any("--device rocm:0 --tier gpu" in c for c in runs), runs
    assert any("--device cpu --tier cpu" in c for c in runs), runs
    assert any("--device opencl:0 --tier gpu" in c for c in runs), runs   # an OpenCL device of unknown type


def test_main_sh_runs_the_cpu_tier_on_opencl_cpu_devices(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('opencl', 0, (('device_type', 'cpu'),)), "
                                         "_D('opencl', 1, (('device_type', 'gpu'),))]")
    assert r.returncode == 0, r.stderr
    assert any("--device opencl:0 --tier cpu" in c for c in runs), runs   # PoCL: the CPU's tier
    assert any("--device opencl:1 --tier gpu" in c for c in runs), runs
    assert len(runs) == 3, runs


def test_main_sh_fails_when_the_devices_cannot_be_listed(tmp_path):
    r, runs = _main_sh_sandbox(tmp_path, "raise RuntimeError('the driver is broken')")
    assert r.returncode != 0 and runs == []
    assert "listing the devices failed" in r.stderr


# -- usage errors -------------------------------------------------------------------------------------

def test_list_of_a_glob_matching_nothing_is_a_usage_error(capsys):
    from portakern.conformance import cli_main

    assert cli_main(["--list", "--cases", "no-such-case-*", "--tier", "gpu"]) == 2
    assert "matches no case of cases-v1 tier gpu; list the ids with: portakern conformance --list --tier gpu" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--repeat", "0"], "repeat=0 must be >= 1 (--repeat N runs every case N times; 1 runs each once"),
    (["--jobs", "-3"], "jobs=-3 must be >= 0 (0 = one worker per CPU core) (--jobs N; 1 runs every case"),
])
def test_bad_numbers_name_the_option_and_the_way_out(capsys, argv, fragment):
    from portakern.conformance import cli_main

    assert cli_main(["--backend", "cpu", "--cases", ONE, *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_main_sh_runs_each_gpu_once_on_the_gpu_tier_with_workers(tmp_path):
    # the gpu tier holds every cpu-tier case, so a cpu-tier run before it repeated 439 cases per backend;
    # and a serial run compiles some 300 kernels one after another (--jobs 0: one worker per core)
    r, runs = _main_sh_sandbox(tmp_path, "return [_D('cpu', 0), _D('cuda', 0)]")
    assert r.returncode == 0, r.stderr
    cuda = [c for c in runs if "--device cuda:0" in c]
    assert len(cuda) == 1 and "--tier gpu" in cuda[0] and "--report reports/cuda-0.json" in cuda[0], runs
    assert all("--jobs 0" in c for c in runs), runs


def test_test_sh_conformance_steps_show_progress(tmp_path):
    # CI logs are not a terminal: the runner then prints one line per 10 %; --no-progress left the
    # interpreter run (many minutes) silent until its end
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text((repo / "scripts" / "test.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("true\n")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text("#!/usr/bin/env bash\nexit 0\n")
    (bin_ / "portakern").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path}/calls\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh")], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PORTAKERN_SKIP_SLOW_CONFORMANCE"})
    calls = (tmp_path / "calls").read_text().splitlines()
    assert r.returncode == 0, r.stderr
    assert len(calls) == 5 and all(c.startswith("conformance") for c in calls), calls   # triton x2, cuda, opencl x2
    assert any("--backend cuda --compile-only" in c for c in calls), calls
    assert any("--backend opencl --device opencl:0" in c for c in calls), calls
    assert any("--backend opencl --device cpu" in c for c in calls), calls
    assert not any("--no-progress" in c for c in calls), calls
