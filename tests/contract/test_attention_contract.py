"""The attention contract, checked on every registered backend through ``portakern.attention(..., backend=name)``.

What every backend owes a caller, whatever its kernels: values within the dtype's tolerance of a float64
reference (``contract_reference.attention64``), query head h reading kv head ``h // (Hq // Hkv)``, every output
element written (outputs are NaN-poisoned first), the output of the input's array type, device and dtype, LSE as
the natural log of the summed exponentiated scores in float32 ``(B, Hq, Sq)``, rows that see no key as zeros with
an LSE of ``-inf``, per-batch key lengths, paged and varlen layouts, strided inputs and index arrays read as the
views they are (or refused naming them), empty batches, and bad input refused before any kernel with a specific
error. A problem a backend does not support is skipped with that backend's own reason (``supports()``, asked
through ``portakern.explain``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import portakern
from portakern.ir import expr as E

from contract_reference import attention64
from contract_targets import ATOL, LSE_ATOL, host, poisoned, skip_unless_supported

pytestmark = pytest.mark.contract


def rand(seed, *shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def qkv(seed, B, Sq, Sk, Hq, Hkv, D, Dv=None):
    return rand(seed, B, Sq, Hq, D), rand(seed + 1, B, Sk, Hkv, D), rand(seed + 2, B, Sk, Hkv, Dv or D)


def run(target, dtype, q, k, v, aux=None, **kw):
    """``portakern.attention`` of numpy ``q, k, v`` (cast to ``dtype``) and index arrays ``aux`` on ``target``,
    forced to its backend, outputs poisoned: skips if the backend does not support it; checks the result's array
    type, device, dtypes, shapes and that no element was left unwritten. Returns what the backend received and
    the results, all as float64 numpy: ``(q, k, v), out, lse``."""
    args = [target.array(a, dtype) for a in (q, k, v)]
    idx = {n: target.array(a) for n, a in (aux or {}).items()}
    skip_unless_supported(portakern.attention, *args, backend=target.backend, return_lse=True, **idx, **kw)
    with poisoned():
        out, lse = portakern.attention(*args, backend=target.backend, return_lse=True, **idx, **kw)
    varlen = "cu_seqlens_q" in idx
    rows = q.shape[:1] if varlen else q.shape[:2]
    target.check_like(out, dtype, (*rows, q.shape[-2], v.shape[-1]))
    target.check_like(lse, "float32", (q.shape[-2], *rows) if varlen else (rows[0], q.shape[-2], rows[1]))
    o, l = host(out), host(lse)
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} output elements unwritten (still NaN) or NaN"
    assert not np.isnan(l).any(), f"{int(np.isnan(l).sum())} lse elements unwritten (still NaN) or NaN"
    return [host(a) for a in args], o, l


def close(out, lse, ref, dtype):
    ref_out, ref_lse = ref
    err = np.abs(out - ref_out).max(initial=0.0)
    assert err <= ATOL[dtype], f"max |out - float64| = {err:.3g} > {ATOL[dtype]}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse is -inf on other rows than the reference"
    fin = np.isfinite(ref_lse)
    if fin.any():
        lerr = np.abs(lse[fin] - ref_lse[fin]).max()
        assert lerr <= LSE_ATOL, f"max |lse - float64| = {lerr:.3g} > {LSE_ATOL}"


# -- values, dtypes, head mapping ---------------------------------------------------------------------

#: (B, Sq, Sk, Hq, Hkv, D, Dv), options
SHAPES = {
    "mha": ((2, 5, 7, 2, 2, 16, 16), {}),
    "gqa-causal": ((1, 6, 9, 4, 2, 32, 32), dict(causal=True)),
    "mqa-decode": ((2, 1, 40, 4, 1, 64, 64), {}),
    "dv-differs-causal": ((1, 5, 8, 2, 1, 32, 16), dict(causal=True)),
    "gqa2-d59": ((2, 5, 37, 4, 2, 59, 59), {}),
    "mqa-decode-d111-dv64": ((1, 1, 70, 4, 1, 111, 64), {}),
    "more-q-than-k-dv96-causal": ((1, 21, 9, 4, 4, 32, 96), dict(causal=True)),
    "d192-dv128-causal": ((2, 19, 67, 4, 2, 192, 128), dict(causal=True)),
    "mqa-softcap-causal": ((1, 9, 31, 4, 1, 64, 64), dict(causal=True, softcap=4.0)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_float64_in_every_dtype(target, dtype, shape):
    (B, Sq, Sk, Hq, Hkv, D, Dv), kw = SHAPES[shape]
    (q, k, v), out, lse = run(target, dtype, *qkv(1, B, Sq, Sk, Hq, Hkv, D, Dv), **kw)
    close(out, lse, attention64(q, k, v, **kw), dtype)


ALIBI = [0.5, 0.25, 0.125, 0.0625]

#: options, and the float64 reference's view of them
VARIANTS = {
    "window": (dict(window=(3, 1)), dict(window=(3, 1))),
    "window-left-unbounded": (dict(window=(-1, 2)), dict(window=(-1, 2))),
    "causal-window": (dict(causal=True, window=(4, 0)), dict(causal=True, window=(4, 0))),
    "softcap-causal": (dict(softcap=2.0, causal=True), dict(softcap=2.0, causal=True)),
    "scale": (dict(scale=-0.3, causal=True), dict(scale=-0.3, causal=True)),
    "alibi-causal": (dict(score_mod=E.alibi_score(ALIBI), causal=True),
                     dict(score=lambda s, b, h, i, j, sq, sk: s - np.asarray(ALIBI)[h] * np.abs(i + sk - sq - j),
                          causal=True)),
    "custom": (dict(mask_mod=((E.kv_idx - E.q_idx) * 2 > -7) | E.b.eq(1),
                    score_mod=E.where(E.h > 1, E.score * 0.5, E.score + E.kv_idx / 16)),
               dict(mask=lambda b, h, i, j, sq, sk: ((j - i) * 2 > -7) | (b == 1),
                    score=lambda s, b, h, i, j, sq, sk: np.where(h > 1, s * 0.5, s + j / 16))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_masks_and_score_modifiers_match_float64(target, variant):
    kw, ref_kw = VARIANTS[variant]
    (q, k, v), out, lse = run(target, "float32", *qkv(2, 2, 9, 14, 4, 2, 16), **kw)
    close(out, lse, attention64(q, k, v, **ref_kw), "float32")


@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
def test_query_head_h_reads_kv_head_h_div_group(target, Hkv):
    """The same numbers as MHA over k / v with each kv head repeated ``Hq // Hkv`` times by hand."""
    q, k, v = qkv(3, 2, 4, 11, 4, Hkv, 16)
    _, grouped, grouped_lse = run(target, "float32", q, k, v, causal=True)
    kr, vr = (np.repeat(a, 4 // Hkv, axis=2) for a in (k, v))
    _, repeated, repeated_lse = run(target, "float32", q, kr, vr, causal=True)
    np.testing.assert_allclose(grouped, repeated, atol=ATOL["float32"], rtol=0)
    np.testing.assert_allclose(grouped_lse, repeated_lse, atol=LSE_ATOL, rtol=0)


# -- rows that see no key ---------------------------------------------------------------------------

def test_rows_before_the_causal_diagonal_are_zero_with_minus_inf_lse(target):
    """Causal with Sq > Sk: query i sees keys j <= i + Sk - Sq, so the first Sq - Sk rows see none."""
    (q, k, v), out, lse = run(target, "float32", *qkv(4, 1, 12, 5, 2, 2, 16), causal=True)
    assert np.all(out[:, :7] == 0) and np.all(np.isneginf(lse[:, :, :7]))
    assert np.all(np.isfinite(lse[:, :, 7:])) and np.abs(out[:, 7:]).max() > 0
    close(out, lse, attention64(q, k, v, causal=True), "float32")


def test_a_score_of_minus_inf_hides_a_key_and_a_head_of_them_gives_zeros(target):
    hide = E.where(E.h.eq(1), E.const(-math.inf), E.score)
    _, out, lse = run(target, "float32", *qkv(5, 1, 6, 9, 2, 2, 16), score_mod=hide)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isneginf(lse[:, 1]))
    assert np.all(np.isfinite(lse[:, 0])) and np.abs(out[:, :, 0]).max() > 0


def test_a_mask_that_hides_every_key_gives_zeros_and_minus_inf(target):
    _, out, lse = run(target, "float32", *qkv(6, 1, 3, 30, 2, 1, 32), mask_mod=E.kv_idx < 0)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


# -- key lengths, paged, varlen ----------------------------------------------------------------------

def test_per_batch_key_lengths_including_zero(target):
    lens = np.array([40, 0, 23], np.int32)
    q, k, v = qkv(7, 3, 7, 40, 4, 2, 32)
    k[1], v[1] = 1e30, 1e30                       # keys past a length are never read
    k[2, 23:], v[2, 23:] = 1e30, 1e30
    (q, k, v), out, lse = run(target, "float32", q, k, v, {"seqlens_k": lens}, causal=True)
    close(out, lse, attention64(q, k, v, causal=True, lens_k=lens), "float32")
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_kv_through_a_shuffled_block_table(target, page_size):
    rng = np.random.default_rng(8)
    B, Sq, Hq, Hkv, D = 3, 4, 4, 2, 32
    lens = np.array([1, 37, 0], np.int32)
    max_pages = -(-40 // page_size)
    pages = B * max_pages + 2
    kp, vp = rand(9, pages, page_size, Hkv, D), rand(10, pages, page_size, Hkv, D)
    table = rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    q = rand(11, B, Sq, Hq, D)
    (q, kp, vp), out, lse = run(target, "float32", q, kp, vp, {"block_table": table, "seqlens_k": lens}, causal=True)
    kd = np.stack([kp[table[b]].reshape(-1, Hkv, D) for b in range(B)])   # the pages gathered here, dense
    vd = np.stack([vp[table[b]].reshape(-1, Hkv, D) for b in range(B)])
    close(out, lse, attention64(q, kd, vd, causal=True, lens_k=lens), "float32")
    assert np.all(out[2] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sequences_including_empty_ones(target, causal):
    q_lens, k_lens = [3, 0, 5, 2], [4, 6, 0, 9]
    cu_q, cu_k = np.cumsum([0] + q_lens).astype(np.int32), np.cumsum([0] + k_lens).astype(np.int32)
    q, k, v = rand(12, cu_q[-1], 4, 16), rand(13, cu_k[-1], 2, 16), rand(14, cu_k[-1], 2, 16)
    (q, k, v), out, lse = run(target, "float32", q, k, v, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k},
                              causal=causal)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if q_lens[b] == 0:
            continue
        ref_out, ref_lse = attention64(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        close(out[qs], lse[:, qs], (ref_out[0], ref_lse[0]), "float32")


# -- strided inputs and index arrays ------------------------------------------------------------------

def _column(target, values):
    """``values`` as int32 column 0 of a ``(n, 2)`` table whose column 1 holds 99: a view of stride 2, which a kernel
    reading it at unit stride would see as ``values[0], 99, values[1], ...``."""
    return target.array(np.array([[x, 99] for x in values], np.int32))[:, 0]


def _strided_or_refused(call, argument):
    """``call()``'s result, or None when it refused a strided index array with a portakern error naming
    ``argument`` (the other outcome the contract allows: never a misread, nor another library's error)."""
    try:
        return call()
    except (portakern.InvalidInputError, portakern.InvalidTypeError) as e:
        assert argument in str(e), f"the refusal does not name {argument}: {e}"
        return None


def test_index_arrays_given_as_strided_views_are_read_as_the_views_or_refused(target):
    """A column of a wider table (stride 2) as seqlens_k / cu_seqlens: the results of its values (a kernel reading it
    at unit stride would see 99s), or a portakern error naming the argument."""
    q, k, v = (target.array(a, "float32") for a in qkv(15, 3, 1, 40, 2, 2, 16))
    lens = _column(target, [7, 33, 20])
    skip_unless_supported(portakern.attention, q, k, v, seqlens_k=target.array(np.array([7, 33, 20], np.int32)),
                          backend=target.backend)
    got = _strided_or_refused(lambda: portakern.attention(q, k, v, seqlens_k=lens, backend=target.backend),
                              "seqlens_k")
    if got is not None:
        want = attention64(host(q), host(k), host(v), lens_k=[7, 33, 20])[0]
        np.testing.assert_allclose(host(got), want, atol=ATOL["float32"], rtol=0)
    q, k, v = (target.array(a, "float32") for a in (rand(16, 5, 2, 16), rand(17, 25, 2, 16), rand(18, 25, 2, 16)))
    cu_q, cu_k = _column(target, [0, 2, 5]), _column(target, [0, 10, 25])
    skip_unless_supported(portakern.attention, q, k, v, cu_seqlens_q=target.array(np.array([0, 2, 5], np.int32)),
                          cu_seqlens_k=target.array(np.array([0, 10, 25], np.int32)), backend=target.backend)
    got = _strided_or_refused(lambda: portakern.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                          backend=target.backend), "cu_seqlens_q")
    if got is not None:
        got = host(got)
        for qs, ks in ((slice(0, 2), slice(0, 10)), (slice(2, 5), slice(10, 25))):
            want = attention64(host(q)[None, qs], host(k)[None, ks], host(v)[None, ks])[0][0]
            np.testing.assert_allclose(got[qs], want, atol=ATOL["float32"], rtol=0)


def test_strided_q_k_v_give_the_results_of_their_values(target):
    """q stored BHSD (transposed), k and v halves of one packed K|V buffer with a padded head dim."""
    qs = rand(19, 2, 4, 17, 32).astype(np.float16)
    kv = rand(20, 2, 29, 2, 2, 48).astype(np.float16)
    q = target.permute(target.array(qs, "float16"), (0, 2, 1, 3))
    kvd = target.array(kv, "float16")
    k, v = kvd[:, :, :, 0, :32], kvd[:, :, :, 1, 8:40]
    skip_unless_supported(portakern.attention, q, k, v, causal=True, backend=target.backend)
    with poisoned():
        out = portakern.attention(q, k, v, causal=True, backend=target.backend)
    target.check_like(out, "float16", (2, 17, 4, 32))
    want = attention64(qs.transpose(0, 2, 1, 3), kv[:, :, :, 0, :32], kv[:, :, :, 1, 8:40], causal=True)[0]
    np.testing.assert_allclose(host(out), want, atol=ATOL["float16"], rtol=0)


# -- array types, devices, empty batches ---------------------------------------------------------------

def test_results_are_of_the_inputs_array_type_device_and_dtype(target_lib, dtype):
    (q, k, v), out, lse = run(target_lib, dtype, *qkv(21, 1, 6, 11, 2, 1, 16), causal=True)
    close(out, lse, attention64(q, k, v, causal=True), dtype)


@pytest.mark.parametrize("B, Sq", [(0, 4), (3, 0)], ids=["batch", "seqlen_q"])
def test_no_query_rows_give_empty_results_of_the_inputs_kind(target_lib, B, Sq):
    q, k, v = (target_lib.array(a, "float16") for a in (rand(22, B, Sq, 2, 8), rand(23, B, 4, 1, 8),
                                                         rand(24, B, 4, 1, 16)))
    one_row = [target_lib.array(a, "float16") for a in qkv(22, 1, 1, 4, 2, 1, 8, 16)]
    skip_unless_supported(portakern.attention, *one_row, backend=target_lib.backend)
    out, lse = portakern.attention(q, k, v, return_lse=True, backend=target_lib.backend)
    target_lib.check_like(out, "float16", (B, Sq, 2, 16))
    target_lib.check_like(lse, "float32", (B, 2, Sq))


# -- bad input is refused before any kernel -----------------------------------------------------------

def test_bad_input_is_refused_with_the_same_specific_error_on_every_backend(target):
    q, k, v = (target.array(a, "float32") for a in qkv(25, 2, 3, 8, 4, 2, 16))
    bad_k = target.array(rand(26, 2, 8, 2, 32), "float32")
    cases = [
        (lambda: portakern.attention(q, bad_k, v, backend=target.backend), portakern.InvalidInputError,
         "k head_dim 32 != q head_dim 16: q and k must share head_dim"),
        (lambda: portakern.attention(q, target.array(rand(27, 2, 8, 2, 16), "float16"), v, backend=target.backend),
         portakern.InvalidTypeError, "q, k, v dtypes differ (float32, float16, float32): cast them to one dtype"),
        (lambda: portakern.attention(q, k, v, window=(1, 2, 3), backend=target.backend), portakern.InvalidInputError,
         "window=(1, 2, 3) must be a (left, right) pair of ints"),
        (lambda: portakern.attention(q, k, v, seqlens_k=target.array(np.array([3, 9], np.int32)),
                                     backend=target.backend),
         portakern.InvalidInputError, "seqlens_k=[3, 9] must lie in [0, 8]"),
    ]
    other = rand(28, 2, 8, 2, 16).astype(np.float32)
    if target.lib != "numpy":
        cases.append((lambda: portakern.attention(q, other, v, backend=target.backend), portakern.InvalidTypeError,
                      "but q is a"))
    for call, exc, fragment in cases:
        with pytest.raises(exc) as info:
            call()
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
        assert isinstance(info.value, ValueError if exc is portakern.InvalidInputError else TypeError)
