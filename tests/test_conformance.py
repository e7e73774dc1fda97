"""The conformance suite itself: generator bit-identity, case coverage, goldens, the full cpu tier."""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from portakern.conformance import generate as gen
from portakern.conformance import goldens as G
from portakern.conformance import tolerance as T
from portakern.conformance.cases import HEAD_DIMS, all_cases, select

CPU_CASES = all_cases("cpu")


# -- generator ---------------------------------------------------------------------------------

def _splitmix_by_hand(seed: int, stream: str, n: int) -> list[int]:
    """The documented algorithm in plain Python integers (no numpy)."""
    M = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    key = int.from_bytes(hashlib.sha256(stream.encode()).digest()[:8], "little")
    base = mix(seed ^ key)
    return [mix((base + (i + 1) * 0x9E3779B97F4A7C15) & M) for i in range(n)]


def test_mix_matches_vigna_splitmix64_reference_vector():
    # SplitMix64 from state 1234567: the published first outputs
    state, out = 1234567, []
    for _ in range(3):
        state = (state + gen.GAMMA) & gen.MASK64
        out.append(gen.mix64_int(state))
    assert out == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_stream_first_values_are_hard_coded():
    # computed once from the algorithm; they must never change (every golden depends on them)
    assert gen.words(42, "q", 4).tolist() == [9358824232693777333, 11451379668817453024,
                                              11788008863846202698, 9073939396871351398]
    assert gen.floats(42, "q", (4,), "bfloat16", 3.0).tolist() == [0.0439453125, 0.7265625, 0.8359375,
                                                                     -0.048583984375]
    cid = "attn-d128-sq113-sk512-h4g4-b1-causal-bf16"
    assert gen.seed_of(cid) == 0x4DE47CA9BC2F0DDA
    assert gen.seed_of(cid) == int.from_bytes(hashlib.sha256(b"seed:" + cid.encode()).digest()[:8], "little")


def test_numpy_streams_equal_the_hand_computed_algorithm():
    for seed, stream in ((0, "k"), (gen.MASK64, "codes"), (123456789, "x")):
        assert gen.words(seed, stream, 257).tolist() == _splitmix_by_hand(seed, stream, 257)


def test_rounding_to_storage_dtypes_is_round_to_nearest_even():
    tie_down, tie_up = 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8          # halfway between bf16 neighbours
    assert gen.round_to(np.array([tie_down, tie_up]), "bfloat16").tolist() == [1.0, 1 + 2.0 ** -6]
    assert gen.round_to(np.array([1 + 2.0 ** -11]), "float16").tolist() == [1.0]
    x = gen.floats(7, "v", (1000,), "float16", 4.0)
    assert np.array_equal(x, x.astype(np.float16).astype(np.float32))
    assert gen.integers(3, "z", (10000,), 1, 17).min() == 1 and gen.integers(3, "z", (10000,), 1, 17).max() == 16
    assert sorted(gen.permutation(5, "p", 100).tolist()) == list(range(100))


# -- cases -------------------------------------------------------------------------------------

def test_case_counts_and_ids():
    attn = [c for c in CPU_CASES if c.kind == "attention"]
    gemv = [c for c in CPU_CASES if c.kind == "quant_gemv"]
    assert len(attn) >= 280 and len(gemv) >= 120
    ids = [c.id for c in all_cases("gpu")]
    assert len(ids) == len(set(ids))
    assert len(all_cases("gpu")) > len(CPU_CASES) and all(c.tier == "gpu" for c in all_cases("gpu")[len(CPU_CASES):])
    assert "attn-d128-sq113-sk512-h4g4-b1-causal-fp16-lse" in ids


def test_cases_cover_the_issue_list():
    attn = [c for c in CPU_CASES if c.kind == "attention"]
    assert set(HEAD_DIMS) <= {c.D for c in attn}
    pairs = {(c.Sq, c.Sk) for c in attn if c.layout == "dense"}
    assert {(1, 1), (1, 4096), (239, 1), (113, 512), (1023, 1023)} <= pairs
    assert any(sq > sk for sq, sk in pairs)
    assert {1, 4, 8} <= {c.Hq // c.Hkv for c in attn}
    assert {"float16", "bfloat16", "float32"} == {c.dtype for c in attn}
    assert {16, 64, 256} == {c.page_size for c in attn if c.layout == "paged"}
    assert any(c.layout == "varlen" for c in attn) and any(c.return_lse for c in attn)
    kinds = {c.tags[0] for c in attn}
    assert {"causal", "window", "softcap", "alibi", "bias", "rowmask", "custommask"} <= kinds
    assert any(c.causal for c in attn if c.Sq > c.Sk)                      # fully masked rows
    gemv = [c for c in CPU_CASES if c.kind == "quant_gemv"]
    formats = {(c.packing, c.bits, c.symmetric, c.has_g_idx) for c in gemv}
    assert len(formats) == 12                                               # cases-v3: + Q4_K, Q5_K, Q6_K
    assert {32, 64, 128} <= {c.group_size for c in gemv} and any(c.group_size == c.K for c in gemv)
    assert {1, 2, 7, 16} <= {c.M for c in gemv}
    assert any(c.N % 64 and c.K % 64 for c in gemv)
    assert {"float16", "bfloat16", "float32"} == {c.dtype for c in gemv}


def test_select_globs():
    assert len(select(CPU_CASES, "gemv-awq-*")) == len([c for c in CPU_CASES if c.id.startswith("gemv-awq-")])
    both = select(CPU_CASES, "gemv-q4_0-*,gemv-q8_0-*")
    assert {c.packing for c in both} == {"gguf_q4_0", "gguf_q8_0"}


# -- tolerances -------------------------------------------------------------------------------

def test_tolerance_table_covers_every_case_and_is_looser_than_naive():
    for c in CPU_CASES:
        r = T.rule(c.kind, c.dtype)
        assert r.factor >= 1 and r.abs_floor > 0
        if c.kind == "quant_gemv":
            assert r.nmse is not None
    # the stored naive NMSE sits well below the bound of every quantized case
    store = G.Store()
    for cid, e in store.cases.items():
        if e["op"] == "quant_gemv":
            assert e["naive_nmse"] * 5 < T.rule("quant_gemv", e["dtype"]).nmse, cid


def test_compare_rules():
    gold = np.array([1.0, -np.inf, 0.5])
    assert T.compare(np.array([1.0, -np.inf, 0.5]), gold, 1e-3).ok
    v = T.compare(np.array([1.0, 0.0, 0.5]), gold, 1e-3, what="lse")
    assert not v.ok and "lse[1]" in v.reason
    v = T.compare(np.array([np.nan, -np.inf, 0.5]), gold, 1e9)
    assert not v.ok and "nan" in v.reason
    v = T.compare(np.array([1.01, -np.inf, 0.5]), gold, 1e-3)
    assert not v.ok and v.max_abs_err == pytest.approx(0.01)
    assert not T.compare(np.ones(2), np.ones(3), 1).ok
    assert not T.compare(np.array([1.0, 2.0]), np.array([1.0, 2.001]), 1.0, nmse_bound=1e-9).ok
    assert T.trim_mantissa(np.array([1 + 2.0 ** -13], np.float32), 12).tolist() == [1.0]
    assert T.trim_mantissa(np.array([-np.inf], np.float32), 12).tolist() == [-np.inf]


# -- the whole cpu tier through the runner ------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    from portakern.conformance.runner import run

    d = tmp_path_factory.mktemp("conformance")
    paths = {k: d / f"r.{k}" for k in ("json", "md", "xml")}
    report, code = run(backends=["cpu"], device="cpu", report=paths["json"], markdown=paths["md"],
                       junit=paths["xml"], progress=False, out=None)
    return report, code, paths


def test_cpu_backend_passes_the_whole_cpu_tier(cpu_run):
    report, code, _ = cpu_run
    bad = [r for r in report["results"] if r["status"] != "pass"]
    assert code == 0 and not bad, bad[:5]
    assert len(report["results"]) == len(CPU_CASES)


def test_report_schema(cpu_run):
    report, _, paths = cpu_run
    on_disk = json.loads(paths["json"].read_text())
    assert on_disk["results"] == report["results"]
    for key in ("format", "suite", "tier", "mode", "created", "portakern", "device", "packages", "backends",
                "git", "summary", "exit_status", "results"):
        assert key in on_disk, key
    assert on_disk["device"]["type"] == "cpu" and on_disk["packages"]["numpy"]
    assert on_disk["summary"]["cpu"]["attention"]["pass"] > 0
    for r in on_disk["results"]:
        assert {"case", "backend", "device", "status", "max_abs_err", "tolerance", "time_ms", "reason"} <= set(r)
        assert r["status"] in ("pass", "fail", "unsupported", "error", "nondeterministic")
        assert r["max_abs_err"] <= r["tolerance"]
    md = paths["md"].read_text()
    n = len([c for c in CPU_CASES if c.kind == "attention"])
    assert f"| attention | pass {n}/{n} |" in md
    root = ET.fromstring(paths["xml"].read_text())
    suite = root.find("testsuite")
    assert suite.get("name") == "cpu@cpu" and int(suite.get("tests")) == len(CPU_CASES)
    assert int(suite.get("failures")) == 0 and len(suite.findall("testcase")) == len(CPU_CASES)
