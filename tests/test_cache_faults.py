"""Tuning-cache fault injection (``portakern.cache.TuningCache``), on the CPU without triton.

Every unreadable entry is a miss -- deeply nested JSON (RecursionError), truncated JSON, wrong types, a foreign
version, binary garbage, a file that cannot be read -- and the next ``put`` repairs it. Temp files left by a
writer killed mid-write are removed once stale, a live writer's never. Through the public path, a corrupt
ranking under ``use_policy("fastest")`` costs a measurement, not the call.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import portakern
from portakern import cache, measure
from portakern.backends.cpu.backend import CpuBackend
from portakern.cache import TuningCache
from portakern.devices import CPU, Device
from plugin_helpers import provides  # noqa: E402

DEV = Device("cuda", 0, "sm_90", "test GPU", (9, 0), 32)
VERSIONS = {"portakern": "test", "triton": "test"}


def _tagged(c: TuningCache, entries) -> str:
    return json.dumps({"tag": c.tag, "entries": entries})


# what a damaged cache file may hold: name -> bytes, given the cache (for its tag)
CORRUPT = {
    "deeply-nested": lambda c: b"[" * 200000,
    "deeply-nested-object": lambda c: b'{"a":' * 100000,
    "truncated": lambda c: _tagged(c, {"k": {"a": 1}}).encode()[:-7],
    "empty": lambda c: b"",
    "binary-garbage": lambda c: bytes(range(256)) * 40,
    "invalid-utf8": lambda c: b'{"tag": "\xff\xfe"}',
    "top-level-list": lambda c: b"[1, 2, 3]",
    "top-level-string": lambda c: b'"entries"',
    "top-level-null": lambda c: b"null",
    "tag-of-another-type": lambda c: json.dumps({"tag": [c.tag], "entries": {"k": 1}}).encode(),
    "foreign-version": lambda c: json.dumps({"tag": "0" * 20, "entries": {"k": 1}}).encode(),
    "no-tag": lambda c: json.dumps({"entries": {"k": 1}}).encode(),
    "entries-list": lambda c: _tagged(c, [["k", 1]]).encode(),
    "entries-null": lambda c: _tagged(c, None).encode(),
    "nan-literal": lambda c: b'{"tag": NaN',
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_file_is_a_miss_and_the_next_put_repairs_it(cache_dir, kind):
    c = TuningCache("ns", DEV, VERSIONS)
    c.path.write_bytes(CORRUPT[kind](c))
    fresh = TuningCache("ns", DEV, VERSIONS)
    assert fresh.get("k") is None and fresh.get("k", "default") == "default"
    fresh.put("k", {"a": 1})
    assert json.loads(c.path.read_text()) == {"tag": c.tag, "entries": {"k": {"a": 1}}}
    assert TuningCache("ns", DEV, VERSIONS).get("k") == {"a": 1}


def test_a_directory_in_place_of_the_file_is_a_miss(cache_dir):
    c = TuningCache("ns", DEV, VERSIONS)
    c.path.mkdir(parents=True)
    assert c.get("k") is None


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(5, "Input/output error")])
def test_an_unreadable_file_is_a_miss(cache_dir, monkeypatch, error):
    """Permission bits do not stop root (CI containers), so the read itself is made to fail."""
    c = TuningCache("ns", DEV, VERSIONS)
    c.put("k", 1)
    real = type(c.path).read_bytes

    def read_bytes(path):
        if path == c.path:
            raise error
        return real(path)

    monkeypatch.setattr(type(c.path), "read_bytes", read_bytes)
    assert TuningCache("ns", DEV, VERSIONS).get("k") is None


def test_entries_of_a_foreign_version_are_never_served(cache_dir):
    TuningCache("ns", DEV, {"portakern": "0.0.1", "triton": "test"}).put("k", "old")
    assert TuningCache("ns", DEV, VERSIONS).get("k") is None


# -- temp files of a killed writer ------------------------------------------------------------------

def _temp(directory, name, age_s):
    p = directory / name
    p.write_text('{"tag": "half a wri')
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_put_removes_stale_temp_files_of_a_killed_writer_and_keeps_live_ones(cache_dir):
    stale = _temp(cache_dir, ".tmp-killedwriter.json", cache.STALE_TMP_S + 60)
    live = _temp(cache_dir, ".tmp-livewriter.json", 1)               # another writer, mid-write
    just_under = _temp(cache_dir, ".tmp-slowwriter.json", cache.STALE_TMP_S - 60)
    unrelated = _temp(cache_dir, "notes-tmp.json", cache.STALE_TMP_S * 10)   # not ours: never touched
    TuningCache("ns", DEV, VERSIONS).put("k", 1)
    assert not stale.exists()
    assert live.exists() and just_under.exists() and unrelated.exists()
    assert TuningCache("ns", DEV, VERSIONS).get("k") == 1
    assert sorted(p.name for p in cache_dir.glob(".tmp-*")) == [".tmp-livewriter.json", ".tmp-slowwriter.json"]


def test_remove_stale_temp_files_rule(cache_dir):
    a = _temp(cache_dir, ".tmp-a.json", 10)
    now = time.time()
    assert cache.remove_stale_temp_files(cache_dir, now=now) == [] and a.exists()
    assert cache.remove_stale_temp_files(cache_dir, now=now + cache.STALE_TMP_S + 11) == [a] and not a.exists()
    assert cache.remove_stale_temp_files(cache_dir / "absent") == []   # a missing directory is no error


def test_a_temp_file_with_a_future_time_is_kept(cache_dir):
    """Clock skew between hosts sharing the directory: a temp file dated in the future is not stale."""
    p = _temp(cache_dir, ".tmp-future.json", -3600)
    TuningCache("ns", DEV, VERSIONS).put("k", 1)
    assert p.exists()


# -- the public path --------------------------------------------------------------------------------

class CpuTwin(CpuBackend):
    """The cpu reference kernel under a second name, so "fastest" has two candidates to rank."""

    name = "cpu-twin"


@pytest.mark.parametrize("kind", ["deeply-nested", "truncated", "binary-garbage", "entries-list"])
def test_fastest_policy_with_a_corrupt_ranking_measures_instead_of_raising(cache_dir, register_plugin, kind):
    register_plugin(provides(CpuTwin()), name="cpu-twin")
    path = measure._tuning_cache(CPU).path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(CORRUPT[kind](measure._tuning_cache(CPU)))
    q = np.ones((1, 2, 1, 8), np.float32)
    with portakern.use_policy("fastest"):
        out = portakern.attention(q, q, q)
        d = portakern.explain(portakern.attention, q, q, q)
    assert np.allclose(out, 1.0)
    assert d.ranked_by in ("measured", "tuning cache") and d.measured_us
    assert {"cpu", "cpu-twin"} <= set(json.loads(path.read_text())["entries"].popitem()[1])  # repaired
