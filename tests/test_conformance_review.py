"""Defects found reviewing the conformance tools: each test failed before its fix.

Reports keep every result (non-finite figures, Ctrl-C, unwritable paths), goldens cannot be
silently replaced by the backend under test, and runs that check nothing do not pass.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from portakern.backends.cpu.backend import CpuBackend
from portakern.conformance import report as R
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


class ReviewPlugin:
    @hookimpl
    def portakern_register_backends(self):
        return [NanLse()]


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
