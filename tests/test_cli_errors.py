"""Error paths of the ``portakern`` command line found by a review: every bad argument exits 2 with
one message that names the option, the value and the way out, and never a traceback."""

from __future__ import annotations

import json

import pytest

from portakern import cli


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


ATT = ["explain", "attention"]
QG = ["explain", "quant_gemv"]


# -- explain: negative sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (ATT + ["--shape=1,1,8,2,2,-64"], "--shape '1,1,8,2,2,-64': D=-64 must be a positive integer"),
    (ATT + ["--shape=-1,1,8,2,2,64"], "--shape '-1,1,8,2,2,64': B=-1 must be a positive integer"),
    (ATT + ["--shape", "1,1,8,2,2,64", "--dv=-3"], "--dv -3: the value head dim must be a positive integer"),
    (QG + ["--shape=-1,64,128"], "--shape '-1,64,128': M=-1 must be a positive integer"),
    (QG + ["--shape=1,-64,128"], "--shape '1,-64,128': N=-64 must be a positive integer"),
    (QG + ["--shape=1,64,-128"], "--shape '1,64,-128': K=-128 must be a positive integer"),
])
def test_negative_sizes_are_usage_errors_not_tracebacks(fresh_registry, capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and fragment in err, err
    assert "Traceback" not in err and "--help" in err


# -- explain: option values that start with '-' -----------------------------------------------------

def test_window_with_an_unbounded_left_side_is_accepted_as_documented(fresh_registry, capsys):
    # --help says "-1 = unbounded"; argparse took "-1,0" for an option and said "expected one argument"
    code, out, err = run(capsys, *ATT, "--shape", "1,4,8,2,2,64", "--window", "-1,0", "--json")
    assert code == 0, err
    assert json.loads(out)["chosen"] == "cpu"


def test_a_negative_shape_after_a_space_names_the_rule(fresh_registry, capsys):
    code, _, err = run(capsys, *ATT, "--shape", "-1,1,8,2,2,64")
    assert code == 2 and "B=-1 must be a positive integer" in err, err
