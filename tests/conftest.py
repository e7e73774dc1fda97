"""Shared fixtures. Nothing here runs at import time or changes global state outside a fixture."""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import pytest

def interpreting() -> bool:
    """Whether this process runs Triton kernels under Triton's CPU interpreter: ``TRITON_INTERPRET`` set (to other
    than 0) when the process started, before triton's first import (Triton reads it when it decorates a kernel)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``interpreter`` run Triton kernels on the CPU under its interpreter: without TRITON_INTERPRET=1
    they are skipped, saying so. CI runs them in their own step (scripts/test.sh: ``TRITON_INTERPRET=1 pytest -m
    "interpreter or contract"``); the main step deselects them (``-m "not interpreter"``)."""
    if interpreting():
        return
    skip = pytest.mark.skip(reason="runs Triton kernels under Triton's CPU interpreter: needs TRITON_INTERPRET=1 set "
                                   "before the process starts (the interpreter step of scripts/test.sh)")
    for item in items:
        if item.get_closest_marker("interpreter") is not None:
            item.add_marker(skip)


#: Environment variables that steer plugin loading and dispatch.
PORTAKERN_ENV = ("PORTAKERN_BACKEND", "PORTAKERN_STRICT", "PORTAKERN_PLUGINS",
                 "PORTAKERN_DISABLE_PLUGIN_AUTOLOAD", "PORTAKERN_POLICY")


def _torch_devices() -> list[str]:
    """"cpu", plus "cuda" when torch sees a GPU (tests run on every device present)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a test dependency
        return []
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=_torch_devices())
def torch_device(request) -> str:
    """Each torch device present: "cpu", and "cuda" on a GPU machine."""
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, fresh for every test."""
    return np.random.default_rng(1234)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``PORTAKERN_*`` steering variables for the duration of the test (restored after)."""
    for name in PORTAKERN_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def fresh_registry(clean_env: pytest.MonkeyPatch):
    """Rebuild the plugin registry and drop every dispatch plan before and after the test.

    Also restores the list of hand-registered plugins, so a test may ``register`` freely.
    """
    from portakern import plugins

    saved = list(plugins._manual)
    plugins.reset()
    yield plugins
    plugins._manual[:] = saved
    plugins.reset()


@pytest.fixture
def register_plugin(fresh_registry) -> Callable[..., Any]:
    """``register_plugin(obj, name)`` registers a plugin for this test only; returns the registry."""

    def register(obj: Any, name: str | None = None):
        fresh_registry.register(obj, name=name)
        return fresh_registry.registry()

    return register


@pytest.fixture
def qkv(rng) -> Callable[..., tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``qkv(B, Sq, Sk, Hq, Hkv, D, dtype=np.float32)``: random numpy q, k, v in BSHD layout."""

    def make(B=1, Sq=4, Sk=6, Hq=2, Hkv=1, D=16, dtype=np.float32, Dv=None):
        return (rng.standard_normal((B, Sq, Hq, D)).astype(dtype),
                rng.standard_normal((B, Sk, Hkv, D)).astype(dtype),
                rng.standard_normal((B, Sk, Hkv, Dv or D)).astype(dtype))

    return make


def reference_attention(q, k, v, causal: bool = False) -> np.ndarray:
    """A plain float64 numpy attention (dense BSHD, GQA, bottom-right causal) for spot checks."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    k = np.repeat(k, Hq // Hkv, axis=2)
    v = np.repeat(v, Hq // Hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    if causal:
        keep = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq
        s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", np.divide(p, den, out=np.zeros_like(p), where=den > 0), v)
    return o


@pytest.fixture
def ref_attention() -> Callable[..., np.ndarray]:
    """The float64 numpy attention of ``reference_attention``."""
    return reference_attention


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty portakern cache directory (``PORTAKERN_CACHE_DIR``) for the test."""
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path))
    return tmp_path
