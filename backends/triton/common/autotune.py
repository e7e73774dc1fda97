"""Optional autotuning shared by the triton kernels: time candidates once, persist the winner."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable


def cached_best(namespace: str, device: Any, key: str, candidates: Iterable[Any], timer: Callable[[Any], float],
                default: Callable[[], Any], restore: Callable[[dict], Any]) -> Any:
    """The best of ``candidates`` for bucket ``key``, from the on-disk cache or by timing.

    ``timer(cfg)`` returns seconds (a candidate that raises, e.g. out of shared memory, is
    skipped); ``default()`` is used when none ran; ``restore(dict)`` rebuilds a cached entry and
    may raise for an entry it cannot serve (another shape: ``TypeError``; a configuration the weight
    rules out: ``ValueError`` from ``quant_gemv.config.fit``), which is a miss: the bucket is timed again.
    Winners are stored with ``cfg.to_json()`` in a ``portakern.cache.TuningCache`` keyed by device,
    portakern and Triton versions; a cache directory that cannot be written (read-only, full, a path
    under a regular file) warns and returns the measured winner without storing it.
    """
    from portakern import __version__ as pk_version
    from portakern.cache import TuningCache

    import triton

    cache = TuningCache(namespace, device, {"portakern": pk_version, "triton": triton.__version__})
    hit = cache.get(key)
    if isinstance(hit, dict):
        try:
            return restore(hit)
        except Exception:  # noqa: BLE001 - an entry of another shape, or one this weight rules out, is a miss
            pass
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
    try:
        cache.put(key, best.to_json())
    except OSError as e:  # an unwritable cache directory costs a re-tune in a later process, not the backend
        warnings.warn(f"portakern: could not store the autotuned configuration of {namespace} ({key}): {e}",
                      RuntimeWarning, stacklevel=3)
    return best
