"""``LRU``: a dictionary that keeps at most ``maxsize`` entries, forgetting the least recently used one first.

Every in-memory cache of dispatch is one (the plans, the empty-result makers, a plan's kernels per length), so a
process that meets many shapes holds a bounded number of compiled kernels. The sizes are set with
``portakern.dispatch.set_cache_limits``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .errors import InvalidInputError, InvalidTypeError


class LRU(OrderedDict):
    """An ``OrderedDict`` bounded to ``maxsize`` entries: ``get`` marks a hit as the most recent, ``put`` inserts and
    evicts the oldest entries past the bound; ``evictions`` counts them. Reads need no lock (a key evicted by another
    thread meanwhile is simply a miss); ``put`` takes the cache's own lock."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = check_size(maxsize, "maxsize")
        self.evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        value = OrderedDict.get(self, key, default)
        if value is not default:
            try:
                self.move_to_end(key)
            except KeyError:  # evicted by another thread between the two steps
                pass
        return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self[key] = value
            self.move_to_end(key)
            self._trim()

    def resize(self, maxsize: int) -> None:
        """Set the bound (evicting the oldest entries past it at once)."""
        with self._lock:
            self.maxsize = check_size(maxsize, "maxsize")
            self._trim()

    def _trim(self) -> None:
        while len(self) > self.maxsize:
            self.popitem(last=False)
            self.evictions += 1


def check_size(n: Any, argument: str) -> int:
    """``n`` as a cache bound: an int >= 1, else ``InvalidTypeError`` / ``InvalidInputError`` naming ``argument``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidTypeError(f"{argument}={n!r} must be an int (the number of entries the cache keeps)")
    if n < 1:
        raise InvalidInputError(f"{argument}={n} must be >= 1 (the number of entries the cache keeps); to empty the "
                                "caches call portakern.dispatch.clear_cache()")
    return n


__all__ = ["LRU", "check_size"]
