"""The ``portakern`` command line: info, explain, delegation to the conformance tools, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import portakern
from portakern import cli


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- info -------------------------------------------------------------------------------------------

def test_info_text(fresh_registry, capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert f"portakern {portakern.__version__}" in out
    assert "devices" in out and "cpu" in out
    assert "backends" in out and "status ok" in out and "[portakern]" in out


def test_info_json(fresh_registry, capsys):
    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert code == 0 and info["portakern"] == portakern.__version__
    assert info["devices"][0]["type"] == "cpu"
    cpu = next(b for b in info["backends"] if b["name"] == "cpu")
    assert cpu["distribution"] == "portakern" and cpu["plugin"] == "cpu" and cpu["device_types"] == ["cpu"]
    assert cpu["status"] == "ok" and "version" in cpu and "compile_targets" in cpu and "priority" in cpu
    triton = next(b for b in info["backends"] if b["name"] == "triton")
    assert "sm_100a" in triton["compile_targets"]
    assert info["plugin_errors"] == []


def test_info_reports_a_broken_plugin_and_still_lists_the_rest(fresh_registry, capsys, tmp_path, monkeypatch):
    (tmp_path / "pk_cli_broken.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PORTAKERN_PLUGINS", "pk_cli_broken")
    fresh_registry.reset()
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert "plugin errors" in out and 'Error importing plugin "pk_cli_broken"' in out
    assert "ModuleNotFoundError" in out and "cpu" in out
    code, out, _ = run(capsys, "info", "--json")
    errors = json.loads(out)["plugin_errors"]
    assert errors[0]["plugin"] == "pk_cli_broken" and "not_a_real_dependency_xyz" in errors[0]["error"]


def test_info_survives_a_backend_whose_status_raises(register_plugin, capsys):
    class Grumpy(portakern.Backend):
        name = "grumpy"

        def status(self):
            raise OSError("driver went away")

    class Plugin:
        @portakern.hookimpl
        def portakern_register_backends(self):
            return [Grumpy()]

    register_plugin(Plugin(), name="grumpy")
    code, out, _ = run(capsys, "info")
    assert code == 0 and "status() raised OSError: driver went away" in out


# -- explain ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--causal"], ["--window", "16,0"], ["--softcap", "30"],
                                   ["--paged", "16"], ["--varlen"], ["--dtype", "fp16", "--return-lse"],
                                   ["--dtype", "fp32", "--dv", "32", "--scale", "0.5"]])
def test_explain_attention(fresh_registry, capsys, extra):
    code, out, _ = run(capsys, "explain", "attention", "--shape", "2,3,40,8,2,64", *extra)
    assert code == 0, out
    assert "chosen   cpu" in out and "* cpu" in out and out.startswith("op       attention ")


def test_explain_attention_json(fresh_registry, capsys):
    code, out, _ = run(capsys, "explain", "attention", "--shape", "1,1,4096,32,8,128", "--dtype", "bf16",
                       "--causal", "--paged", "16", "--json")
    d = json.loads(out)
    assert code == 0 and d["chosen"] == "cpu"
    op = d["op"]
    assert (op["batch"], op["seqlen_q"], op["heads_q"], op["heads_kv"], op["head_dim"]) == (1, 1, 32, 8, 128)
    assert op["dtype"] == "bfloat16" and op["kv_layout"] == "paged" and op["page_size"] == 16
    assert op["seqlen_k"] == 4096 and op["mask_mod"] is not None


@pytest.mark.parametrize("packing", ["native", "awq", "gptq", "gguf_q4_0", "gguf_q8_0"])
def test_explain_quant_gemv(fresh_registry, capsys, packing):
    fmt = [] if packing.startswith("gguf") else ["--bits", "4", "--group-size", "128"]  # gguf fixes both
    code, out, _ = run(capsys, "explain", "quant_gemv", "--shape", "4,256,512", *fmt,
                       "--packing", packing, "--dtype", "fp16", "--json")
    d = json.loads(out)
    assert code == 0 and d["chosen"] == "cpu" and d["op"]["fmt"]["packing"] == packing
    assert (d["op"]["M"], d["op"]["N"], d["op"]["K"]) == (4, 256, 512)


def test_explain_quant_gemv_with_the_silu_mul_prologue(fresh_registry, capsys):
    code, out, _ = run(capsys, "explain", "quant_gemv", "--shape", "1,64,256", "--prologue", "silu_mul", "--json")
    d = json.loads(out)
    assert code == 0 and d["chosen"] == "cpu" and d["op"]["prologue"] == "silu_mul" and d["op"]["K"] == 256


def test_explain_quant_gemv_symmetric_8bit_text(fresh_registry, capsys):
    code, out, _ = run(capsys, "explain", "quant_gemv", "--shape", "1,64,256", "--bits", "8", "--symmetric",
                       "--group-size", "0")
    assert code == 0 and "op       quant_gemv" in out and "chosen   cpu" in out


def test_explain_unsupported_forced_backend_exits_1(fresh_registry, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, out, err = run(capsys, "explain", "attention", "--shape", "1,1,8,2,2,64", "--backend", "triton")
    assert code == 1 and "unsupported:" in err and "not supported by triton" in err
    code, out, _ = run(capsys, "explain", "attention", "--shape", "1,1,8,2,2,64", "--backend", "triton", "--json")
    assert code == 1 and json.loads(out)["chosen"] is None


@pytest.mark.parametrize("argv, fragment", [
    (["explain", "attention", "--shape", "1,2,3"], "expected 6 comma-separated integers B,Sq,Sk,Hq,Hkv,D"),
    (["explain", "attention", "--shape", "1,1,8,3,2,64"], "number of query heads must be a multiple"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--dtype", "int8"], "--dtype int8: must be one of"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--dtype", "fp8"], "--dtype fp8: must be one of"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--window", "3"], "--window '3': expected 2"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--paged", "4", "--varlen"], "exclude each other"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--paged", "0"], "--paged 0: the page size must be a positive"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--paged", "-4"], "--paged -4: the page size must be a positive"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--device", "cuda:3"], "--device cuda:3: no such device"),
    (["explain", "attention", "--shape", "1,1,8,2,2,64", "--backend", "nope"], "--backend nope: no backend of that name"),
    (["explain", "quant_gemv", "--shape", "1,64,100", "--group-size", "32"], "group_size=32 does not divide K=100"),
    (["explain", "quant_gemv", "--shape", "1,64,128", "--bits", "3"], "invalid choice: 3 (choose from 4, 5, 6, 8)"),
    (["explain", "quant_gemv", "--shape", "1,64,128", "--bits", "8", "--packing", "awq"],
     "bits=8 is not supported by packing awq"),
    (["explain", "quant_gemv", "--shape", "1,64,128", "--packing", "exl2"], "--packing exl2: expected one of"),
])
def test_bad_arguments_exit_2(fresh_registry, capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and fragment in err, err


def test_argparse_errors_and_help_exit_codes(capsys):
    assert run(capsys, "explain")[0] == 2          # missing OP
    assert run(capsys, "frobnicate")[0] == 2       # unknown command
    assert run(capsys, "explain", "attention")[0] == 2  # missing --shape
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "examples:" in out and "exit status" in out and "conformance" in out
    code, out, _ = run(capsys, "explain", "attention", "--help")
    assert code == 0 and "--paged PAGE" in out and "examples:" in out
    assert run(capsys)[0] == 2                     # no command: help, usage error
    code, out, _ = run(capsys, "--version")
    assert code == 0 and portakern.__version__ in out


# -- delegation to portakern.conformance ------------------------------------------------------------

@pytest.mark.parametrize("command, func", [("conformance", "cli_main"), ("support", "support_main"),
                                           ("goldens", "goldens_main")])
def test_delegates_argv_and_exit_code(monkeypatch, capsys, command, func):
    import portakern.conformance as conformance

    seen = []
    monkeypatch.setattr(conformance, func, lambda argv: seen.append(argv) or 3, raising=False)
    assert cli.main([command, "--backend", "cpu", "--help"]) == 3
    assert seen == [["--backend", "cpu", "--help"]]


def test_delegate_missing_function_exits_2(monkeypatch, capsys):
    import portakern.conformance as conformance

    monkeypatch.delattr(conformance, "goldens_main", raising=False)
    code, _, err = run(capsys, "goldens", "--check")
    assert code == 2 and "has no goldens_main()" in err


def test_delegate_import_failure_exits_2(monkeypatch, capsys):
    monkeypatch.delattr(portakern, "conformance", raising=False)
    monkeypatch.setitem(sys.modules, "portakern.conformance", None)
    code, _, err = run(capsys, "conformance")
    assert code == 2 and "the conformance suite cannot be imported" in err


# -- entry points ----------------------------------------------------------------------------------

def test_python_dash_m_and_console_script(tmp_path):
    r = subprocess.run([sys.executable, "-m", "portakern", "explain", "attention", "--shape", "1,1,8,2,1,16",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chosen"]
    script = Path(sys.executable).parent / "portakern"
    if script.exists():  # the console script of this environment's install
        r = subprocess.run([str(script), "info", "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and json.loads(r.stdout)["backends"]
    r = subprocess.run([sys.executable, "-m", "portakern", "explain", "attention", "--shape", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "expected 6 comma-separated integers" in r.stderr


def test_module_docstring_documents_exit_codes():
    doc = textwrap.dedent(cli.__doc__)
    assert "0   success" in doc and "1   the job ran and found a problem" in doc and "2   usage error" in doc
