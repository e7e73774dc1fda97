"""The suite's own seeded input generator: bit-identical on every machine and numpy version.

numpy's ``Generator`` streams may change between releases and platforms, so the conformance
inputs come from a counter-based SplitMix64 written in plain ``uint64`` array arithmetic (wrapping
multiplication, shifts and xors only, all exact and defined the same everywhere)::

    key       = first 8 bytes (little-endian) of sha256(stream name)
    base      = mix64(seed XOR key)
    word[i]   = mix64(base + (i + 1) * GAMMA)          i = 0, 1, 2, ...   (mod 2^64)
    mix64(z)  = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31

which is Vigna's SplitMix64 (``word[i]`` is the ``i+1``-th output of a SplitMix64 whose state
starts at ``base``). Every named tensor of a case reads its own stream, so adding a tensor never
changes the others.

Floats are built without transcendental functions (whose last bit differs between libms):
``u = (word >> 11) * 2^-53`` is exact in float64, ``x = (2u - 1) * amplitude`` is one IEEE
operation each, then the value is rounded to float32 and to the storage dtype (round to nearest
even: numpy's IEEE casts for float16, the bit rule below for bfloat16). Inputs are *stored* as
float32 arrays whose values are exactly representable in the case's dtype.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import numpy as np

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15     # 2^64 / golden ratio, SplitMix64's increment
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_U64 = np.uint64


def mix64_int(z: int) -> int:
    """SplitMix64's finaliser on one Python int (the scalar twin of ``_mix64``)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> _U64(30))
    z = z * _U64(MIX1)
    z = z ^ (z >> _U64(27))
    z = z * _U64(MIX2)
    return z ^ (z >> _U64(31))


def stream_key(name: str) -> int:
    """The 64-bit key of a named stream: the first 8 bytes of sha256(name), little-endian."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def seed_of(text: str) -> int:
    """A 64-bit seed derived from a case id (so a case's inputs never depend on list order)."""
    return stream_key("seed:" + text)


def words(seed: int, stream: str, n: int) -> np.ndarray:
    """``n`` uint64 words of stream ``stream`` under ``seed`` (see the module docstring)."""
    base = mix64_int((seed ^ stream_key(stream)) & MASK64)
    i = np.arange(1, n + 1, dtype=_U64)
    with np.errstate(over="ignore"):
        return _mix64(_U64(base) + i * _U64(GAMMA))


def uniform(seed: int, stream: str, shape: tuple[int, ...], amplitude: float = 1.0) -> np.ndarray:
    """float64 values in ``[-amplitude, amplitude)`` with 53 random bits each."""
    n = int(np.prod(shape, dtype=np.int64))
    u = (words(seed, stream, n) >> _U64(11)).astype(np.float64) * 2.0 ** -53
    return ((2.0 * u - 1.0) * amplitude).reshape(shape)


def integers(seed: int, stream: str, shape: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """int64 values in ``[lo, hi)`` (``word % (hi - lo)``; the bias is below 2^-50)."""
    n = int(np.prod(shape, dtype=np.int64))
    span = _U64(hi - lo)
    return ((words(seed, stream, n) % span).astype(np.int64) + lo).reshape(shape)


def permutation(seed: int, stream: str, n: int) -> np.ndarray:
    """A permutation of ``range(n)``: the stable argsort of ``n`` stream words."""
    return np.argsort(words(seed, stream, n), kind="stable").astype(np.int64)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of ``x`` rounded (to nearest, ties to even) to ``dtype``'s precision."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    if dtype == "float32":
        return x32
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x32.view(np.uint32)
        with np.errstate(over="ignore"):
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out = rounded.view(np.float32)
        return np.where(np.isnan(x32), x32, out)
    raise ValueError(f"round_to: dtype={dtype!r} is not a storage dtype (float16, bfloat16, float32)")


def floats(seed: int, stream: str, shape: tuple[int, ...], dtype: str, amplitude: float = 1.0) -> np.ndarray:
    """float32 array of uniform values in ``[-amplitude, amplitude]``, exact in ``dtype``."""
    return round_to(uniform(seed, stream, shape, amplitude), dtype)


def hash_arrays(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over every array, by sorted name: name, dtype, shape, then little-endian bytes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        if a is None:
            continue
        a = np.ascontiguousarray(a)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
