"""Persistent on-disk cache for tuning results (and anything small and JSON-shaped).

Entries live in the cache directory (``cache_dir()``: ``$PORTAKERN_CACHE_DIR``, else ``$XDG_CACHE_HOME/portakern``,
else ``~/.cache/portakern``) in one JSON file per namespace and device identity. Writes are atomic (temp file +
``os.replace``); a corrupt file or an entry written by another portakern/Triton version is a miss, never a crash.

Writers of one file take an exclusive lock on its ``<file>.lock`` beside it (``fcntl.flock``) around
read-merge-replace, so processes that store entries at the same time keep every entry: without it, two writers that
read the same old file would each replace it with their own addition and one entry would be lost. The kernel drops
the lock of a killed process. Where ``flock`` is missing (Windows) or refused (some network file systems), the write
goes ahead without it and a race can then cost an entry (a re-tune, never a wrong answer).

A writer killed between creating its temp file (``.tmp-<file stem>-*.json``) and ``os.replace`` leaves it behind.
Each ``put`` removes, while it holds the file's lock, every temp file of that file (no live writer of it can exist
then), and any temp file of the directory whose last modification is more than ``STALE_TMP_S`` (one hour) old. A
live writer's temp file exists only while one small JSON document is written (milliseconds) and its modification
time is that of its last write, so the age rule never meets it; a clock that jumps forward by more than an hour
while a write is in progress is the only way to meet it, and it then costs that write (its ``os.replace`` raises
``OSError``, which callers already treat as "not stored"), never a wrong entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock (see the module docstring)
    fcntl = None

from .devices import Device

FORMAT = 1
TMP_PREFIX, TMP_SUFFIX = ".tmp-", ".json"
STALE_TMP_S = 3600.0  # a temp file untouched for this long belongs to a writer that died (see the module doc)
_lock = threading.Lock()


def cache_dir() -> Path:
    """The cache directory, read from the environment at each call: ``$PORTAKERN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/portakern``, else ``~/.cache/portakern``.

    An empty variable counts as unset, and so does an ``XDG_CACHE_HOME`` that is a relative path (the XDG Base
    Directory rule: such a value is invalid and ignored).
    """
    own = os.environ.get("PORTAKERN_CACHE_DIR")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "portakern"
    return Path.home() / ".cache" / "portakern"


@contextmanager
def file_lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if absent) while the block runs; yields whether it is held.

    Best effort: where ``fcntl`` is missing or the lock file cannot be opened or locked (a read-only directory, a
    file system without ``flock``), the block runs without the lock and ``False`` is yielded.
    """
    if fcntl is None:
        yield False
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:   # another user's lock file in a shared directory: flock needs only a read descriptor
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield False
            return
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)   # closing the last descriptor releases the lock


class TuningCache:
    """A JSON key -> value store for one ``namespace`` on one device, tagged with ``versions``.

    ``versions`` (e.g. ``{"portakern": "0.1.0", "triton": "3.6.0"}``) is part of the file
    identity: a different version reads as empty. Keys are strings (e.g. a problem bucket).
    """

    def __init__(self, namespace: str, device: Device, versions: dict[str, str]):
        ident = json.dumps({"ns": namespace, "device": device.to_json(), "versions": versions,
                            "format": FORMAT}, sort_keys=True)
        self.tag = hashlib.sha256(ident.encode()).hexdigest()[:20]
        self.path = cache_dir() / f"{namespace}-{self.tag}.json"
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._tmp_prefix = f"{TMP_PREFIX}{self.path.stem}-"
        self._data: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        """The entries the file holds now: ``{}`` when it is absent, unreadable, of another tag, or
        not shaped ``{"tag": ..., "entries": {...}}`` (a corrupt file is a miss, never a crash).

        Unreadable covers a file that cannot be opened (permissions, a directory in its place), bytes that are
        no JSON (binary garbage, a truncated write) and JSON nested too deeply for the parser (``RecursionError``).
        """
        try:
            raw = json.loads(self.path.read_bytes())
        except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            return {}
        entries = raw.get("entries") if isinstance(raw, dict) and raw.get("tag") == self.tag else None
        # a matching tag over entries of another type (list, null, string) would make every ``get`` raise
        return entries if isinstance(entries, dict) else {}

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._read()
        return self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._load().get(key, default)

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON-serialisable) and write the file atomically.

        Under the file's lock (see the module docstring), the file is read again and ``key`` merged into what it
        holds then, so entries that other instances or processes stored since this one loaded are kept, not
        overwritten with this instance's older snapshot. Raises ``OSError`` when the cache directory cannot be
        created or written; the entry is then still served by this instance's ``get``.
        """
        with _lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(self.lock_path) as held:
                data = self._data = self._read()
                data[key] = value
                if held:   # no live writer of this file can exist now: any temp file of it is a dead one's
                    _remove_temp_files(self.path.parent, self._tmp_prefix)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self._tmp_prefix, suffix=TMP_SUFFIX)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({"tag": self.tag, "entries": data}, f)
                    # mkstemp creates the file 0600: a cache directory shared between users stays readable
                    os.chmod(tmp, 0o644)
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
            remove_stale_temp_files(self.path.parent)


def _remove_temp_files(directory: Path, prefix: str) -> None:
    """Remove every ``<prefix>*.json`` temp file of ``directory`` (best effort, like ``remove_stale_temp_files``)."""
    try:
        found = list(directory.glob(f"{_glob_escape(prefix)}*{TMP_SUFFIX}"))
    except OSError:
        return
    for tmp in found:
        try:
            tmp.unlink()
        except OSError:
            continue


def _glob_escape(text: str) -> str:
    """``text`` with the glob metacharacters ``*?[`` made literal."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def remove_stale_temp_files(directory: Path, now: float | None = None,
                            pattern: str = f"{TMP_PREFIX}*{TMP_SUFFIX}") -> list[Path]:
    """Remove the temp files (``pattern``, a glob; default ``.tmp-*.json``) in ``directory`` not modified for
    ``STALE_TMP_S`` seconds; return them.

    These are left by writers killed mid-write (see the module docstring for why a live writer's file is never
    stale). A file that vanishes meanwhile (another process cleaned it) or cannot be removed (another user's,
    in a shared directory) is left alone: cleaning is best effort and never fails a write.
    """
    now = time.time() if now is None else now
    removed = []
    try:
        candidates = list(directory.glob(pattern))
    except OSError:
        return removed
    for tmp in candidates:
        try:
            if now - tmp.lstat().st_mtime > STALE_TMP_S:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue
    return removed
