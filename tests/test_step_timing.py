"""benchmarks/step_timing.exposed_times: a replay's span attributed to overlapping kernels (pure arithmetic, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_timing import exposed_times  # noqa: E402


def test_overlapping_kernels_are_charged_what_they_add_to_the_span():
    # a: 0-10; b starts early (a dependent) at 4, ends 13; idle 13-15; c 15-20; d 16-18 runs inside c
    t = exposed_times([("c", 15, 20), ("a", 0, 10), ("b", 4, 13), ("d", 16, 18)])
    by = {k["name"]: k for k in t["kernels"]}
    assert t["span_us"] == 20 and t["idle_us"] == 2
    assert by["a"]["us_exposed"] == 10 and by["b"]["us_exposed"] == 3 and by["b"]["us_duration"] == 9
    assert by["d"]["us_exposed"] == 3      # ends first of the two: (13, 18], of which 15-18 busy (c from 15)
    assert by["c"]["us_exposed"] == 2      # (18, 20]
    assert sum(k["us_exposed"] for k in t["kernels"]) + t["idle_us"] == t["span_us"]
    assert [k["name"] for k in t["kernels"]][0] == "a"


def test_repeated_names_add_up_and_empty_is_zero():
    t = exposed_times([("g", 0, 5), ("g", 5, 9), ("n", 9.5, 10)])
    assert t["kernels"][0] == {"name": "g", "calls": 2, "us_duration": 9, "us_exposed": 9}
    assert t["idle_us"] == 0.5 and t["span_us"] == 10
    assert exposed_times([]) == {"span_us": 0.0, "idle_us": 0.0, "kernels": []}


def test_a_kernel_inside_a_longer_one_is_charged_up_to_its_end():
    t = exposed_times([("long", 0, 10), ("short", 2, 3)])
    by = {k["name"]: k["us_exposed"] for k in t["kernels"]}
    assert by == {"short": 3, "long": 7} and t["idle_us"] == 0 and t["span_us"] == 10
