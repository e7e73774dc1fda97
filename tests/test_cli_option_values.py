"""Command-line values that would silently widen, narrow or break a run: an empty value (an unset shell variable),
an empty item of a comma list, an unknown backend or device, a glob that matches nothing, a corrupt --goldens
manifest. Each is a usage error (exit 2, no traceback) whose message names the option as typed on the command
line (``--backend``), never the Python parameter (``backends=``), and the way out.
"""

from __future__ import annotations

import json

import pytest

from portakern import cli

ONE = "gemv-q8_0-g32-m1-n77-k352-fp32"
ATT = ["explain", "attention", "--shape", "1,4,4,2,1,64"]
QG = ["explain", "quant_gemv", "--shape", "1,64,128"]
PYTHON_NAMES = ("backends=", "backend=", "cases=", "device=", "cases_glob=", "golden_dir=", "repeat=", "jobs=",
                "targets=")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def usage_error(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, out, err)
    assert fragment in err, err
    assert "Traceback" not in err and not any(name in err for name in PYTHON_NAMES), err
    return err


def empty(option):
    return (f"{option} '': the value is empty (an unset shell variable?); give {option} a value, or leave "
            f"{option} out to use its default")


# -- empty values: every option, every command -------------------------------------------------------

@pytest.mark.parametrize("argv, option", [
    (["conformance", "--backend", ""], "--backend"),
    (["conformance", "--backend", " "], "--backend"),
    (["conformance", "--backend", "cpu", "--backend", ""], "--backend"),
    (["conformance", "--cases", ""], "--cases"),
    (["conformance", "--device", ""], "--device"),
    (["conformance", "--device="], "--device"),
    (["conformance", "--compile-only", "--target", ""], "--target"),
    (["conformance", "--report", ""], "--report"),
    (["conformance", "--markdown", ""], "--markdown"),
    (["conformance", "--junit", ""], "--junit"),
    (["conformance", "--goldens", ""], "--goldens"),
    (["goldens", "--dir", ""], "--dir"),
    (["goldens", "--cases", ""], "--cases"),
    (["support", "--output", ""], "--output"),
    (["support", "--check", ""], "--check"),
    (ATT + ["--backend", ""], "--backend"),
    (ATT + ["--device", ""], "--device"),
    (ATT + ["--dtype", ""], "--dtype"),
    (ATT + ["--window", ""], "--window"),
    (QG + ["--backend", ""], "--backend"),
    (QG + ["--packing", ""], "--packing"),
    (QG + ["--device", " "], "--device"),
])
def test_an_empty_value_is_a_usage_error_naming_the_option(fresh_registry, capsys, argv, option):
    usage_error(capsys, argv, empty(option))


@pytest.mark.parametrize("value, option", [(",,", "--backend"), ("cpu,", "--backend"), (",cpu", "--backend"),
                                           ("a,,b", "--cases"), ("attn-*, ", "--cases")])
def test_an_empty_item_of_a_comma_list_is_a_usage_error(fresh_registry, capsys, value, option):
    usage_error(capsys, ["conformance", "--list", option, value],
                f"{option} {value!r}: an empty name in the list (an unset shell variable, a stray comma?) would "
                f"widen or change the selection; name each item, e.g. {option} ")


def test_an_empty_target_item_is_a_usage_error(fresh_registry, capsys):
    usage_error(capsys, ["conformance", "--compile-only", "--backend", "triton", "--target", "sm_90a,"],
                "--target 'sm_90a,': an empty name in the list")


def test_an_empty_backend_does_not_run_every_backend(fresh_registry, capsys, tmp_path):
    """The issue's case: ``--backend "$UNSET"`` ran every backend and exited 0."""
    report = tmp_path / "r.json"
    usage_error(capsys, ["conformance", "--backend", "", "--cases", ONE, "--no-progress", "--report", str(report)],
                empty("--backend"))
    assert not report.exists()


# -- unknown values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["conformance", "--backend", "nosuch", "--cases", ONE, "--no-progress"],
    ["conformance", "--list", "--backend", "cpu,nosuch"],
    ATT + ["--backend", "nosuch"],
    QG + ["--backend", "nosuch"],
])
def test_an_unknown_backend_names_the_option_and_the_registered_ones(fresh_registry, capsys, argv):
    err = usage_error(capsys, argv, "--backend nosuch: no backend of that name is registered; registered backends "
                                    "are ")
    assert "cpu" in err and "portakern info lists them" in err


def test_explain_takes_one_backend(fresh_registry, capsys):
    usage_error(capsys, ATT + ["--backend", "cpu,torch-eager"],
                "--backend cpu,torch-eager: explain forces one backend; name one, e.g. --backend cpu")


@pytest.mark.parametrize("argv", [
    ["conformance", "--backend", "cpu", "--cases", ONE, "--device", "nosuch:7", "--no-progress"],
    ["conformance", "--list", "--device", "nosuch:7"],
    ATT + ["--device", "nosuch:7"],
    QG + ["--device", "nosuch:7"],
])
def test_an_unknown_device_names_the_option_and_the_present_ones(fresh_registry, capsys, argv):
    usage_error(capsys, argv, "--device nosuch:7: no such device on this machine; present devices are cpu")


@pytest.mark.parametrize("argv", [["--list"], ["--backend", "cpu", "--no-progress"]])
def test_a_glob_matching_nothing_names_the_option(fresh_registry, capsys, argv):
    usage_error(capsys, ["conformance", *argv, "--cases", "no-such-case-*"],
                "--cases no-such-case-*: matches no case of cases-v3 tier cpu; list the ids with: "
                "portakern conformance --list --tier cpu")


@pytest.mark.parametrize("argv, fragment", [
    (["--repeat", "0"], "--repeat 0: must be >= 1 (--repeat N runs every case N times; 1 runs each once"),
    (["--jobs", "-3"], "--jobs -3: must be >= 0 (0 = one worker per CPU core; 1 runs every case in this process)"),
])
def test_bad_counts_name_the_option(fresh_registry, capsys, argv, fragment):
    usage_error(capsys, ["conformance", "--backend", "cpu", "--cases", ONE, *argv], fragment)


def test_tier_choices_name_the_option(fresh_registry, capsys):
    usage_error(capsys, ["conformance", "--list", "--tier", ""], "argument --tier: invalid choice: ''")


# -- a corrupt --goldens manifest ----------------------------------------------------------------------

CORRUPT_MANIFESTS = {
    "truncated": '{"suite": "cases-v3", "cases": {"a": ',
    "deeply-nested": "[" * 200000,
    "binary": "\x00\x01\x02garbage",
    "not-an-object": json.dumps(["cases"]),
    "cases-not-an-object": json.dumps({"suite": "cases-v3", "cases": []}),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT_MANIFESTS))
@pytest.mark.parametrize("mode", [["--list"], ["--backend", "cpu", "--cases", ONE, "--no-progress"]])
def test_a_corrupt_goldens_manifest_is_a_usage_error(fresh_registry, capsys, tmp_path, kind, mode):
    (tmp_path / "manifest.json").write_text(CORRUPT_MANIFESTS[kind])
    err = usage_error(capsys, ["conformance", *mode, "--goldens", str(tmp_path)], f"--goldens {tmp_path}: "
                                                                                  f"{tmp_path / 'manifest.json'} ")
    assert f"write a new golden directory with: portakern goldens --force --dir {tmp_path}" in err
    assert "or leave --goldens out to use the package's goldens" in err
    assert ("cannot be read as JSON" in err) == (kind not in ("not-an-object", "cases-not-an-object"))


def test_a_goldens_directory_without_a_manifest_names_the_option(fresh_registry, capsys, tmp_path):
    usage_error(capsys, ["conformance", "--list", "--goldens", str(tmp_path)],
                f"--goldens {tmp_path}: holds no manifest.json, so it is not a golden directory")


def test_goldens_check_of_a_corrupt_manifest_names_dir(fresh_registry, capsys, tmp_path):
    (tmp_path / "manifest.json").write_text(CORRUPT_MANIFESTS["truncated"])
    usage_error(capsys, ["goldens", "--check", "--dir", str(tmp_path), "--cases", ONE],
                f"--dir {tmp_path}: {tmp_path / 'manifest.json'} cannot be read as JSON (JSONDecodeError")
