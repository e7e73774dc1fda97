"""Optional autotuning shared by the triton kernels: time candidates once, persist the winner."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable


def cached_best(namespace: str, device: Any, key: str, candidates: Iterable[Any], timer: Callable[[Any], float],
                default: Callable[[], Any], restore: Callable[[dict], Any]) -> Any:
    """The best of ``candidates`` for bucket ``key``, from the on-disk cache or by timing.

    ``timer(cfg)`` returns seconds (a candidate that raises, e.g. out of shared memory, is
    skipped); ``default()`` is used when none ran; ``restore(dict)`` rebuilds a cached entry and
    may raise ``TypeError`` for an entry of another shape (a miss). Winners are stored with
    ``cfg.to_json()`` in a ``portakern.cache.TuningCache`` keyed by device, portakern and Triton
    versions.
    """
    from portakern import __version__ as pk_version
    from portakern.cache import TuningCache

    import triton

    cache = TuningCache(namespace, device, {"portakern": pk_version, "triton": triton.__version__})
    hit = cache.get(key)
    if isinstance(hit, dict):
        try:
            return restore(hit)
        except TypeError:
            pass  # an entry of another shape is a miss
    best, best_t = None, math.inf
    for cfg in candidates:
        try:
            t = timer(cfg)
        except Exception:  # a candidate that fails to compile (resources) is skipped
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        return default()
    cache.put(key, best.to_json())
    return best
