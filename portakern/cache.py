"""Persistent on-disk cache for tuning results (and anything small and JSON-shaped).

Entries live under ``$PORTAKERN_CACHE_DIR`` (default ``~/.cache/portakern``) in one JSON file per
namespace and device identity. Writes are atomic (temp file + ``os.replace``); a corrupt file or an
entry written by another portakern/Triton version is a miss, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from .devices import Device

FORMAT = 1
_lock = threading.Lock()


def cache_dir() -> Path:
    return Path(os.environ.get("PORTAKERN_CACHE_DIR") or Path.home() / ".cache" / "portakern")


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
        self._data: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        """The entries the file holds now: ``{}`` when it is absent, unreadable, of another tag, or
        not shaped ``{"tag": ..., "entries": {...}}`` (a corrupt file is a miss, never a crash)."""
        try:
            raw = json.loads(self.path.read_text())
            entries = raw.get("entries") if raw.get("tag") == self.tag else None
        except (OSError, ValueError, TypeError, AttributeError):
            return {}
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

        The file is read again just before the write and ``key`` merged into what it holds then, so
        entries that other instances or processes stored since this one loaded are kept, not overwritten
        with this instance's older snapshot. (Without a file lock, two writes racing between that read
        and ``os.replace`` can still drop one entry: a lost entry is a re-tune, never a wrong answer.)
        Raises ``OSError`` when the cache directory cannot be created or written; the entry is then
        still served by this instance's ``get``.
        """
        with _lock:
            data = self._data = self._read()
            data[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"tag": self.tag, "entries": data}, f)
                # mkstemp creates the file 0600: a cache directory shared between users stays readable
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
