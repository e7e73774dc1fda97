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

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            try:
                raw = json.loads(self.path.read_text())
                self._data = raw["entries"] if raw.get("tag") == self.tag else {}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self._data = {}
        return self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._load().get(key, default)

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON-serialisable) and write the file atomically."""
        with _lock:
            data = self._load()
            data[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"tag": self.tag, "entries": data}, f)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
