"""portakern.attention at the edges of its input domain (review-a): 0-d arrays, option values too
large for the math, negative paged lengths, empty dimensions and numpy views a torch backend cannot
wrap. Results are checked against a plain float64 numpy attention written here (never the IR
expressions); every rejection is the specific portakern error, naming argument, value and rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from portakern.arrays import convert_for_backend
from portakern.devices import CPU
from portakern.errors import InvalidInputError, InvalidTypeError, PortakernError

F32 = np.float32


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def attention64(q, k, v, window=None):
    """Dense BSHD float64 attention, GQA, bottom-right aligned ``window=(left, right)`` (negative = unbounded)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    k, v = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    d = i + Sk - Sq
    keep = np.ones((Sq, Sk), bool)
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= d - left
        if right >= 0:
            keep &= j <= d + right
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", np.divide(p, den, out=np.zeros_like(p), where=den > 0), v)


def rejects(call, exc, *fragments):
    with pytest.raises(PortakernError) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    return str(info.value)


Q = rand(1, 4, 2, 8)


# -- 0-d arrays are named by the rank check, not an IndexError from the stride check -----------------

@pytest.mark.parametrize("make", [lambda: np.zeros((), F32), lambda: np.float32(1.0), lambda: torch.zeros(())],
                         ids=["numpy_0d", "numpy_scalar", "torch_0d"])
def test_a_0d_q_is_named_by_the_rank_check(fresh_registry, make):
    q = make()
    kv = torch.from_numpy(Q) if isinstance(q, torch.Tensor) else Q
    rejects(lambda: portakern.attention(q, kv, kv), InvalidInputError, "q has shape ()", "expected 4 dimensions")


