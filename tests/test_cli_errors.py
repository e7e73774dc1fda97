"""Error paths of the ``portakern`` command line: every bad argument exits 2 with
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


# -- support and goldens: paths ---------------------------------------------------------------------

def _conf(capsys, command, *argv) -> tuple[int, str, str]:
    from portakern.conformance import cli as ccli

    code = getattr(ccli, f"{command}_main")(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("option, kind, fragment", [
    ("--output", "dir", "--output {p}: is a directory; name a file, e.g. --output {p}/support.md"),
    ("--output", "missing-parent", "--output {p}: the directory {parent} does not exist; create it first"),
    ("--check", "dir", "--check {p}: is a directory; name the support matrix file, e.g. --check docs/support.md"),
    ("--check", "missing", "--check {p}: no such file; name the support matrix file, e.g. --check docs/support.md"),
])
def test_support_bad_paths_are_usage_errors(capsys, tmp_path, option, kind, fragment):
    p = {"dir": tmp_path, "missing-parent": tmp_path / "no" / "s.md", "missing": tmp_path / "s.md"}[kind]
    code, out, err = _conf(capsys, "support", option, str(p))
    assert code == 2, (out, err)
    assert fragment.format(p=p, parent=p.parent) in err, err
    assert out == ""


@pytest.mark.parametrize("argv", [["--force"], ["--check"], []])
def test_goldens_dir_that_is_a_file_is_a_usage_error(capsys, tmp_path, argv):
    f = tmp_path / "afile"
    f.write_text("not a directory\n")
    code, out, err = _conf(capsys, "goldens", "--dir", str(f), "--cases", "attn-d64-sq1-*", *argv)
    assert code == 2, (out, err)
    assert f"--dir {f}: is a file, not a golden directory; name a directory" in err, err
    assert f.read_text() == "not a directory\n"


# -- argparse errors name the subcommand and its --help ---------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (ATT + ["--shape", "1,1,8,2,2,64", "--bogus"],
     "portakern explain attention: error: unrecognized arguments: --bogus (see: portakern explain attention --help)"),
    (QG + ["--shape", "1,64,128", "--bits", "3"],
     "portakern explain quant_gemv: error: argument --bits: invalid choice: 3 (choose from 4, 5, 6, 8) "
     "(see: portakern explain quant_gemv --help)"),
    (QG + ["--shape", "1,64,128", "--bits", "5"],
     "portakern explain quant_gemv: error: QuantFormat: bits=5 is not supported by packing native: allowed (4, 8) "
     "(see: portakern explain quant_gemv --help)"),
    (["info", "--jsn"], "portakern info: error: unrecognized arguments: --jsn (see: portakern info --help)"),
    (["conformance", "--bogus"],
     "portakern conformance: error: unrecognized arguments: --bogus (see: portakern conformance --help)"),
    (["goldens", "--bogus"], "portakern goldens: error: unrecognized arguments: --bogus (see: portakern goldens --help)"),
    (["support", "--bogus"], "portakern support: error: unrecognized arguments: --bogus (see: portakern support --help)"),
])
def test_argparse_errors_name_the_subcommand_and_its_help(fresh_registry, capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and fragment in err, err


# -- explain quant_gemv: options the packing fixes are not silently dropped -------------------------

@pytest.mark.parametrize("extra, fragment", [
    (["--packing", "awq", "--symmetric"],
     "--symmetric: packing awq always stores zero points; --symmetric applies to --packing native only"),
    (["--packing", "gptq", "--symmetric"], "--symmetric: packing gptq always stores zero points"),
    (["--packing", "gguf_q8_0", "--bits", "4"],
     "--bits 4: packing gguf_q8_0 is always 8 bits; leave --bits out (or pass --bits 8)"),
    (["--packing", "gguf_q4_0", "--group-size", "64"],
     "--group-size 64: packing gguf_q4_0 always has groups of 32; leave --group-size out (or pass --group-size 32)"),
])
def test_quant_gemv_options_that_contradict_the_packing_are_usage_errors(fresh_registry, capsys, extra, fragment):
    code, out, err = run(capsys, *QG, "--shape", "1,64,128", *extra)
    assert code == 2 and fragment in err, err


@pytest.mark.parametrize("extra", [["--packing", "gguf_q8_0", "--bits", "8", "--group-size", "32"],
                                   ["--packing", "gguf_q4_0", "--symmetric"], ["--packing", "native", "--symmetric"]])
def test_quant_gemv_options_that_agree_with_the_packing_are_accepted(fresh_registry, capsys, extra):
    code, out, err = run(capsys, *QG, "--shape", "1,64,128", *extra, "--json")
    assert code == 0, err
    assert json.loads(out)["op"]["fmt"]["packing"] == extra[1]


# -- explain: placeholder arrays that do not fit -----------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])   # torch placeholders, numpy placeholders
def test_a_problem_too_large_to_allocate_is_a_usage_error(fresh_registry, capsys, dtype):
    code, out, err = run(capsys, *ATT, "--shape", "100000,100000,100000,64,8,128", "--dtype", dtype)
    assert code == 2, err
    assert "--shape '100000,100000,100000,64,8,128': the placeholder q of shape (100000, 100000, 64, 128)" in err, err
    assert "cannot be allocated on cpu" in err and "explain a smaller problem" in err and "Traceback" not in err


# -- conformance: targets no backend compiles for; a run where nothing ran ---------------------------

@pytest.mark.parametrize("targets", ["sm90a", "sm_90a,gfx_typo"])
def test_compile_only_target_no_selected_backend_lists_is_a_usage_error(fresh_registry, capsys, targets):
    code, out, err = run(capsys, "conformance", "--compile-only", "--target", targets, "--backend", "triton",
                         "--cases", "attn-d64-sq1-*", "--no-progress")
    bad = targets.split(",")[-1]
    assert code == 2, (out, err)
    assert f"--target {bad}: no selected backend compiles for it (triton: sm_80, sm_90a, sm_100a, sm_120)" in err, err
    assert out == ""


def test_a_run_where_nothing_ran_prints_the_reasons(fresh_registry, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, out, err = run(capsys, "conformance", "--backend", "triton", "--cases", "attn-d64-sq1-*", "--no-progress")
    assert code == 1
    assert "nothing ran" in out
    assert "unsupported reasons:" in err and "4 x triton: " in err and "TRITON_INTERPRET=1" in err, err


# -- explain: --dtype names only what --dtype accepts -----------------------------------------------

@pytest.mark.parametrize("value", ["fp8", "int8", "float64", "int4"])
def test_dtype_error_lists_only_the_storage_dtypes(fresh_registry, capsys, value):
    code, _, err = run(capsys, *ATT, "--shape", "1,1,8,2,2,64", "--dtype", value)
    assert code == 2
    assert f"--dtype {value}: must be one of fp16, bf16, fp32 (or float16, bfloat16, float32)" in err, err
    assert "uint8" not in err and "int64" not in err      # IR dtypes --dtype does not take


@pytest.mark.parametrize("value", ["FP16", "BF16", "Float32"])
def test_dtype_is_case_insensitive(fresh_registry, capsys, value):
    code, out, err = run(capsys, *QG, "--shape", "1,64,128", "--dtype", value, "--json")
    assert code == 0, err
    assert json.loads(out)["op"]["dtype"] in ("float16", "bfloat16", "float32")


@pytest.mark.parametrize("argv, fragment", [
    (ATT + ["--shape", "1,1,8,0,0,64"], "--shape '1,1,8,0,0,64': Hq=0 must be a positive integer"),
    (ATT + ["--shape", "1,1,8,2,2,0"], "--shape '1,1,8,2,2,0': D=0 must be a positive integer"),
    (QG + ["--shape", "0,64,128"], "--shape '0,64,128': M=0 must be a positive integer"),
])
def test_zero_sizes_are_named_in_command_line_terms(fresh_registry, capsys, argv, fragment):
    # before: "q has shape (1, 1, 0, 64) ...: pass non-empty arrays" -- the user passed no array
    code, _, err = run(capsys, *argv)
    assert code == 2 and fragment in err, err
    assert "arrays" not in err


def test_an_invalid_problem_names_the_op_and_its_help(fresh_registry, capsys):
    code, _, err = run(capsys, *QG, "--shape", "1,64,100", "--group-size", "32")
    assert code == 2
    assert err.startswith("portakern explain quant_gemv: error: QuantFormat: group_size=32 does not divide K=100"), err
    assert err.rstrip().endswith("(see: portakern explain quant_gemv --help)"), err


# -- options that exclude each other ----------------------------------------------------------------

@pytest.mark.parametrize("a, b", [("--report", "--markdown"), ("--markdown", "--junit"), ("--report", "--junit")])
def test_two_reports_on_one_path_are_a_usage_error(fresh_registry, capsys, tmp_path, a, b):
    # before: the later writer silently replaced the earlier (a "report: x.json" that held Markdown)
    path = tmp_path / "r.out"
    code, out, err = run(capsys, "conformance", "--backend", "cpu", "--cases", "attn-d64-sq1-*", "--no-progress",
                         a, str(path), b, str(tmp_path / "." / "r.out"))
    assert code == 2, (out, err)
    assert f"{a} and {b} name the same file ({path}); give each report its own path" in err, err
    assert not path.exists()


def test_goldens_force_and_check_exclude_each_other(capsys):
    from portakern.conformance import cli as ccli

    code = ccli.goldens_main(["--force", "--check", "--cases", "attn-d64-sq1-*"])
    err = capsys.readouterr().err
    assert code == 2 and "--force and --check exclude each other" in err, err


# -- --help explains every option -------------------------------------------------------------------

def test_conformance_help_explains_goldens(capsys):
    # --goldens was hidden (argparse.SUPPRESS), though the runner's own error message names it
    from portakern.conformance.cli import _run_parser

    hidden = [a.option_strings for a in _run_parser()._actions if a.help in (None, "", "==SUPPRESS==")]
    assert hidden == [], hidden
    code, out, _ = run(capsys, "conformance", "--help")
    assert code == 0 and "--goldens DIR" in out and "manifest.json" in out


# -- Ctrl-C -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, patch", [(["info"], ("cli", "cmd_info")),
                                            (["goldens", "--cases", "attn-d64-sq1-*"], ("ccli", "goldens_main"))])
def test_ctrl_c_exits_130_without_a_traceback(fresh_registry, capsys, monkeypatch, command, patch):
    import portakern.conformance as ccli

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr({"cli": cli, "ccli": ccli}[patch[0]], patch[1], interrupted)
    code, _, err = run(capsys, *command)
    assert code == 130 and f"portakern {command[0]}: interrupted (Ctrl-C)" in err, err
