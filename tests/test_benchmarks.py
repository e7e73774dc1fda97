"""The official benchmark commands (``benchmarks/``): each answers ``--help`` without a GPU, ``run_gpu.sh`` names only
what exists, result files are named by benchmark and device, and ``benchmarks/README.md`` indexes every kept result,
report and plot (and names no file that is gone)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402  (benchmarks/harness.py)

#: the commands README.md lists, each with ``--help``
COMMANDS = ("gemv.py", "gemv_table_sweep.py", "attention.py", "decode_step.py", "dispatch_overhead.py",
            "gemv_memory.py", "gemv_sass_count.py", "profile_kernels.py", "plot_gemv.py", "plot_decode_step.py")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_answers_help_without_a_gpu(command):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(BENCH / command), "--help"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: "), p.stdout[:200]


def test_every_command_is_in_the_readme_and_run_gpu_names_only_what_exists():
    readme = (BENCH / "README.md").read_text()
    for command in COMMANDS:
        assert command in readme, command
    script = (BENCH / "run_gpu.sh").read_text()
    named = set(re.findall(r"\b((?:benchmarks|tests)/[\w/]+\.py)\b", script))
    assert named, "run_gpu.sh names no script"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"run_gpu.sh names scripts that are not in the tree: {missing}"
    # every step the header documents has a case, and every case is documented
    documented = set(re.findall(r"^#   ([a-z0-9-]+) ", script, re.M))
    cases = set(re.findall(r"^        ([a-z0-9-]+)\)", script, re.M))
    assert documented == cases, (sorted(documented - cases), sorted(cases - documented))


def test_no_benchmark_file_over_500_lines_or_with_session_history():
    for path in BENCH.glob("*.py"):
        text = path.read_text()
        assert text.count("\n") <= 500, f"{path.name}: {text.count(chr(10))} lines (split it by concern)"
        assert not re.search(r"\bsessions? \d+|\bsession-\d+", text), f"{path.name} tells session history"


def test_result_names_say_benchmark_tag_and_card():
    assert harness.card_of("NVIDIA H200") == "h200"
    assert harness.card_of("NVIDIA H100 80GB HBM3") == "h100"
    assert harness.card_of("Graphics Device") == "gpu"
    assert harness.result_path("out", "gemv", card="h200") == os.path.join("out", "gemv-h200.json")
    assert harness.result_path("out", "gemv-wide-sweep", "-m4", card="h100") == \
        os.path.join("out", "gemv-wide-sweep-m4-h100.json")
    for bad in ("m4", "-S27", "-a b", "-"):
        with pytest.raises(ValueError, match=r"tag=.*'-' followed by lower-case letters, digits and '-'"):
            harness.result_path("out", "gemv", bad, card="h200")


def _indexed(readme: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))


def test_the_readme_indexes_every_kept_result_report_and_plot():
    readme = (BENCH / "README.md").read_text()
    names = _indexed(readme)
    results = {p.name for p in (BENCH / "results").iterdir()}
    reports = {p.stem for p in (ROOT / "conformance" / "reports").iterdir()}
    plots = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.png")}
    assert results - names == set(), "result files missing from benchmarks/README.md"
    assert reports - names == set(), "conformance reports missing from benchmarks/README.md"
    assert plots - names == set(), "plots missing from benchmarks/README.md"
    commands = {n for n in names if n.startswith("python ")}
    gone = sorted(n for n in names - results - reports - plots - commands)
    assert not gone, f"benchmarks/README.md indexes files that are not in the tree: {gone}"


def test_kept_names_carry_no_date_or_session_tag():
    kept = [p.name for p in (BENCH / "results").iterdir()] + [p.name for p in (ROOT / "conformance" / "reports").iterdir()]
    kept += [p.name for p in (ROOT / "docs").glob("*.png")]
    dated = [n for n in kept if re.search(r"\d{4}-\d{2}-\d{2}|-s\d+[a-z]?\b|-v\d+\b", n)]
    assert not dated, dated


def test_gemv_memory_measures_llama3_8b_shaped_linears():
    import gemv_memory

    shapes = gemv_memory.linears(2)
    assert [s[0] for s in shapes[:7]] == [f"layers.0.{n}" for n in ("q", "k", "v", "o", "gate", "up", "down")]
    assert sum(N * K for _, N, K in shapes) == 2 * 218_103_808 and gemv_memory.per_param(545, 1000) == 0.545


def test_e2e_breakdown_charges_each_kernel_family_its_exposed_time():
    """``e2e_decode.summarise_spans``: two steps of made-up kernel spans (us) -- a GEMV overlapping the next by
    2 us (a programmatic dependent launch), attention, an Inductor kernel, a 5 us gap -- give per token the exposed
    time per family (the overlap counted once), the idle gap and the span."""
    import e2e_decode

    spans = []
    for t0 in (0.0, 100.0):
        spans += [("gemv_small_m", t0, t0 + 10), ("gemv_frag_kernel", t0 + 8, t0 + 20),
                  ("_attn_fwd_decode", t0 + 20, t0 + 50), ("triton_poi_fused_rms_norm_0", t0 + 55, t0 + 60)]
    got = e2e_decode.summarise_spans(spans, tokens=2)
    assert got["families_us_per_token"] == {"attention": 30.0, "portakern quant_gemv": 20.0, "Inductor glue": 5.0}
    # the steps' gaps: 5 us inside each step, 40 us between the two (charged to the second step's first kernel's
    # stretch as idle), over 2 tokens
    assert got["idle_us_per_token"] == 25.0 and got["span_us_per_token"] == 80.0
    assert got["top_kernels"][0]["name"] == "_attn_fwd_decode" and got["top_kernels"][0]["calls_per_token"] == 1


def test_e2e_decode_runs_its_code_path_on_a_tiny_cpu_model(tmp_path):
    """``benchmarks/e2e_decode.py --dry-run``: every family's build and both modes (generate with the static cache,
    the compiled step in a plain loop) on a 2-layer tiny config on the CPU; torchao is skipped with its reason where it
    does not import. Figures mean nothing there; the JSON's shape and the token agreement do."""
    pytest.importorskip("transformers")
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(BENCH / "e2e_decode.py"), "--dry-run", "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "e2e-decode-dry-run-cpu.json").read_text())
    modes = res["modes"]
    assert set(modes) == {"portakern-generate", "portakern-loop", "bf16-loop", "torchao-loop"}
    for name in ("portakern-generate", "portakern-loop", "bf16-loop"):
        assert modes[name]["ms_per_token_best"] > 0 and modes[name]["weight_bytes"] > 0, (name, modes[name])
    # int4 linears read fewer bytes than the bf16 model's; generate and the loop decode the same tokens
    assert modes["portakern-loop"]["weight_bytes"] < modes["bf16-loop"]["weight_bytes"]
    assert res["portakern_generate_and_loop_tokens_agree"] is True
    ao = modes["torchao-loop"]
    assert "ms_per_token_best" in ao or ao["skipped"].startswith("torchao does not import")
    assert res["config"]["layers"] == 2 and res["targets"]["loop_frac_floor"] == 0.7
