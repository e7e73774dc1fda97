"""Tuning-cache faults across processes and environments (``portakern.cache``), on the CPU without triton.

Files a reader may meet -- corrupt, truncated, of a foreign version, deeply nested -- are each a miss (the per-kind
table is tests/test_cache_faults.py; here they are met together in one directory, through every reader). A writer
killed with SIGKILL in the middle of a write leaves the other entries intact and its temp file is removed by the
next write. Processes that store entries at the same time lose none (the file lock). The cache directory and the
conformance goldens' cache follow ``XDG_CACHE_HOME``, read when used, not at import.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from portakern import cache
from portakern.cache import TuningCache
from portakern.devices import Device

DEV = Device("cuda", 0, "sm_90", "test GPU", (9, 0), 32)
VERSIONS = {"portakern": "test", "triton": "test"}

# a child's view of the same cache: the device and versions above, built from JSON
CHILD_CACHE = textwrap.dedent("""
    import json, os, sys, time
    from portakern.cache import TuningCache
    from portakern.devices import Device
    dev = Device("cuda", 0, "sm_90", "test GPU", (9, 0), 32)
    def cache(ns="ns"):
        return TuningCache(ns, dev, {"portakern": "test", "triton": "test"})
""")


def _corruptions(c: TuningCache) -> dict[str, bytes]:
    return {
        "corrupt": bytes(range(256)) * 8,
        "truncated": json.dumps({"tag": c.tag, "entries": {"k": {"a": 1}}}).encode()[:-3],
        "foreign-version": json.dumps({"tag": "f" * 20, "entries": {"k": {"a": 1}}}).encode(),
        "deeply-nested": b'{"tag": ' + b"[" * 100000,
    }


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "foreign-version", "deeply-nested"])
def test_a_damaged_file_is_a_miss_for_every_namespace_reader(cache_dir, kind):
    c = TuningCache("ns", DEV, VERSIONS)
    cache_dir.mkdir(exist_ok=True)
    c.path.write_bytes(_corruptions(c)[kind])
    other = TuningCache("other", DEV, VERSIONS)
    other.put("x", 1)                                          # a neighbour file is written and read normally
    assert TuningCache("ns", DEV, VERSIONS).get("k") is None
    assert TuningCache("other", DEV, VERSIONS).get("x") == 1


# -- a writer killed mid-write ------------------------------------------------------------------------------------

KILLED_WRITER = CHILD_CACHE + textwrap.dedent("""
    import portakern.cache as pc
    c = cache()
    c.put("before", 1)                           # an entry stored by this writer earlier
    real_replace = os.replace
    def stuck(src, dst):                         # the temp file is written; stop before it replaces the file
        open(os.environ["PK_TEST_MARK"], "w").write(src)
        time.sleep(600)
    pc.os.replace = stuck
    c.put("lost", 2)
""")


@pytest.mark.subprocess
def test_a_writer_killed_mid_write_keeps_the_entries_and_its_temp_file_is_cleaned(cache_dir, python_child, tmp_path):
    TuningCache("ns", DEV, VERSIONS).put("other", {"x": 1})    # another process's entry, already stored
    mark = tmp_path / "mark"
    child = python_child(KILLED_WRITER, PORTAKERN_CACHE_DIR=str(cache_dir), PK_TEST_MARK=str(mark))
    deadline = time.monotonic() + 60
    while not mark.exists() or not mark.read_text():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child never reached its write"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    left = sorted(p.name for p in cache_dir.glob(".tmp-*.json"))
    assert left and os.path.basename(mark.read_text()) in left   # the killed writer's temp file is there
    # the file is whole: the entries stored before the kill, not the one being written
    assert TuningCache("ns", DEV, VERSIONS).get("other") == {"x": 1}
    assert TuningCache("ns", DEV, VERSIONS).get("before") == 1
    assert TuningCache("ns", DEV, VERSIONS).get("lost") is None
    # the next write (the killed writer's lock died with it: no wait) cleans the temp file at once
    t0 = time.monotonic()
    TuningCache("ns", DEV, VERSIONS).put("after", 3)
    assert time.monotonic() - t0 < 10
    assert sorted(p.name for p in cache_dir.glob(".tmp-*.json")) == []
    fresh = TuningCache("ns", DEV, VERSIONS)
    assert (fresh.get("other"), fresh.get("before"), fresh.get("after")) == ({"x": 1}, 1, 3)


def test_a_temp_file_of_another_cache_file_is_left_to_the_age_rule(cache_dir):
    """Another namespace's writer may be mid-write: only its age may make its temp file stale."""
    other = TuningCache("other", DEV, VERSIONS)
    cache_dir.mkdir(exist_ok=True)
    theirs = cache_dir / f".tmp-{other.path.stem}-live.json"
    theirs.write_text('{"tag": "half')
    TuningCache("ns", DEV, VERSIONS).put("k", 1)
    assert theirs.exists()


# -- concurrent writers ---------------------------------------------------------------------------------------------

WRITER = CHILD_CACHE + textwrap.dedent("""
    me, n = int(sys.argv[1]), int(sys.argv[2])
    while not os.path.exists(os.environ["PK_TEST_GO"]):
        time.sleep(0.001)
    for i in range(n):
        cache().put(f"w{me}-{i}", [me, i])     # a fresh instance per put: each reads the file again
""")


@pytest.mark.subprocess
def test_concurrent_processes_writing_the_cache_lose_no_entry(cache_dir, tmp_path):
    import subprocess

    from fault_helpers import ROOT, child_env

    writers, puts = 4, 60
    go = tmp_path / "go"
    env = child_env(PORTAKERN_CACHE_DIR=str(cache_dir), PK_TEST_GO=str(go))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(puts)], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for w in range(writers)]
    try:
        time.sleep(1.0)        # let every child import portakern, then start them together
        go.write_text("go")
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.stderr.close()
    entries = TuningCache("ns", DEV, VERSIONS)._read()
    missing = [f"w{w}-{i}" for w in range(writers) for i in range(puts) if f"w{w}-{i}" not in entries]
    assert not missing, f"{len(missing)} of {writers * puts} entries lost, e.g. {missing[:5]}"
    assert sorted(p.name for p in cache_dir.glob(".tmp-*.json")) == []


def test_threads_of_one_process_writing_the_cache_lose_no_entry(cache_dir):
    import threading

    def write(me):
        for i in range(40):
            TuningCache("ns", DEV, VERSIONS).put(f"t{me}-{i}", i)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(TuningCache("ns", DEV, VERSIONS)._read()) == 8 * 40


def test_the_lock_file_cannot_be_created_the_write_still_happens(cache_dir, monkeypatch):
    """A lock file that cannot be opened (a directory in its place) costs the lock, not the write."""
    c = TuningCache("ns", DEV, VERSIONS)
    c.lock_path.mkdir(parents=True)
    c.put("k", 1)
    assert TuningCache("ns", DEV, VERSIONS).get("k") == 1


# -- where the caches live ----------------------------------------------------------------------------------------

@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("PORTAKERN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_the_cache_directory_follows_xdg_cache_home(xdg):
    assert cache.cache_dir() == xdg / "portakern"
    c = TuningCache("ns", DEV, VERSIONS)
    c.put("k", 1)
    assert c.path.parent == xdg / "portakern" and c.path.is_file()


@pytest.mark.parametrize("value", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, value):
    monkeypatch.delenv("PORTAKERN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / ".cache" / "portakern"


def test_portakern_cache_dir_wins_over_xdg(xdg, monkeypatch, tmp_path):
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path / "own"))
    assert cache.cache_dir() == tmp_path / "own"


def test_the_goldens_cache_follows_xdg_set_after_import(xdg, monkeypatch):
    """conformance.goldens was imported before the variable was set: the directory is read when used."""
    from portakern.conformance import cases, goldens

    case = next(c for c in cases.all_cases("gpu") if not goldens.is_stored_case(c))
    monkeypatch.setattr(goldens, "compute", lambda c: goldens.Golden(c.id, "0" * 64, _zeros(), None, 0.0, 0.0, 0.0))
    goldens.golden_for(case, None)
    written = list((xdg / "portakern" / "conformance").rglob(f"{case.id}-*.npz"))
    assert len(written) == 1


def _zeros():
    import numpy as np

    return np.zeros((1, 1), np.float32)


def test_another_users_lock_file_is_locked_through_a_read_descriptor(cache_dir, monkeypatch):
    """A shared cache directory: the lock file belongs to another user and cannot be opened for writing (permission
    bits do not stop root, so the refusal is injected); flock through a read-only descriptor still holds the lock."""
    real_open = os.open
    modes = []

    def shared_open(path, flags, *mode):
        modes.append(flags)
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    c = TuningCache("ns", DEV, VERSIONS)
    cache_dir.mkdir(exist_ok=True)
    c.lock_path.write_text("")
    monkeypatch.setattr(cache.os, "open", shared_open)
    with cache.file_lock(c.lock_path) as held:
        assert held
    assert modes[-1] == os.O_RDONLY
    c.put("k", 1)
    assert TuningCache("ns", DEV, VERSIONS).get("k") == 1
