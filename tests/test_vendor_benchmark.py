"""benchmarks/vendor_backends.py's judgement, without a GPU: which backends a conformance report leaves uncertified,
and that an uncertified backend is never the fastest correct one nor a RANK_OVER_OWN candidate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import vendor_backends as V  # noqa: E402  (benchmarks/ is a script folder)

CARD = "NVIDIA H100 80GB HBM3"


def _report(path: Path, card: str, statuses: dict[str, list[str]]) -> str:
    results = [{"case": f"c{i}", "backend": b, "status": s} for b, ss in statuses.items() for i, s in enumerate(ss)]
    path.write_text(json.dumps({"device": {"name": card}, "results": results}))
    return str(path)


def test_a_backend_failing_or_erroring_a_case_is_uncertified_per_report(tmp_path):
    a = _report(tmp_path / "a.json", CARD, {"fa4": ["pass", "fail", "fail", "unsupported"], "torch": ["pass"]})
    b = _report(tmp_path / "b.json", CARD, {"fa4": ["error"], "triton": ["pass", "unsupported"]})
    assert V.uncertified([a, b], CARD) == {"fa4": "failing case(s): 2 in a.json, 1 in b.json"}
    assert V.uncertified([], CARD) == {}


def test_a_report_of_another_card_is_refused_naming_both(tmp_path):
    a = _report(tmp_path / "h200.json", "NVIDIA H200", {"fa4": ["pass"]})
    with pytest.raises(ValueError, match=r"h200\.json: that report ran on 'NVIDIA H200', this GPU is 'NVIDIA H100"):
        V.uncertified([a], CARD)


def _row(times: dict[str, float], auto: str) -> dict:
    return {"backends": {n: {"us": t, "graph_us": t / 2} for n, t in times.items()}, "auto": auto}


def test_an_uncertified_vendor_is_timed_but_never_the_fastest_nor_a_candidate():
    row = V.judge(_row({"triton": 100.0, "fa4": 70.0, "torch": 95.0}, "triton"), {"fa4": "failing case(s): 10"})
    assert row["backends"]["fa4"]["uncertified"] == "failing case(s): 10" and row["backends"]["fa4"]["us"] == 70.0
    assert row["fastest"] == row["fastest_graph"] == "torch"
    assert row["auto_over_fastest"] == pytest.approx(100 / 95 - 1)
    assert row["candidate_rank_over_own"] == row["candidate_rank_over_own_graph"] == "torch"   # 5% ahead of triton


def test_a_certified_vendor_more_than_3_percent_ahead_is_the_candidate():
    row = V.judge(_row({"triton": 100.0, "fa4": 70.0, "cuda": 98.0}, "triton"), {})
    assert row["fastest"] == "fa4" and row["candidate_rank_over_own"] == "fa4"
    assert row["auto_over_fastest"] == pytest.approx(100 / 70 - 1)
    close = V.judge(_row({"triton": 100.0, "fa4": 98.0}, "triton"), {})
    assert close["fastest"] == "fa4" and "candidate_rank_over_own" not in close              # within 3%: no row
