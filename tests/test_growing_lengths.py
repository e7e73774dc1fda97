"""Growing sequence lengths on the hot path: one plan per shape class, bounded caches, the one-time cost in explain.

A decode loop grows the key length by one each step; every step must reuse the plan of its shape class
(``portakern.lengths``) and give the values of a float64 reference at its own length.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import portakern
from portakern import Backend, FallbackWarning, dispatch, hookimpl
from portakern.backend import YES, no
from portakern.backends.cpu.backend import CpuBackend
from portakern.errors import BackendError, InvalidInputError, InvalidTypeError


def reference(q, k, v, causal=False, cu_q=None, cu_k=None):
    """float64 softmax(q k^T / sqrt(D)) v, bottom-right causal, GQA by repeating kv heads; varlen per sequence."""
    if cu_q is not None:
        return np.concatenate([reference(q[None, a:b], k[None, c:d], v[None, c:d], causal)[0]
                               for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])])
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.fixture
def limits():
    """Restore the cache bounds after a test that changes them; start from no plans."""
    dispatch.clear_cache()
    yield
    dispatch.set_cache_limits(**dispatch.CACHE_LIMITS)
    dispatch.clear_cache()


def made() -> int:
    return dispatch.cache_info()["plans_made"]


def test_a_decode_loop_plans_once_per_shape_class(rng, limits):
    B, Hq, Hkv, D = 2, 4, 2, 16
    q = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    cache = rng.standard_normal((2, B, 40, Hkv, D)).astype(np.float32)
    before = made()
    for L in range(1, 41):      # a growing cache, a fresh contiguous copy each step (as torch.cat makes)
        k, v = cache[0, :, :L].copy(), cache[1, :, :L].copy()
        out = portakern.attention(q, k, v, causal=True, backend="cpu")
        np.testing.assert_allclose(out, reference(q, k, v, causal=True), rtol=2e-5, atol=2e-6, err_msg=f"Sk={L}")
    assert made() - before == 2          # the classes Sk = 1 and Sk >= 2
    assert dispatch.cache_info()["lengths_compiled"] == 0   # the cpu kernel reads the lengths at run time


def test_views_of_a_static_cache_and_growing_prefill_share_plans(rng, limits):
    cache = rng.standard_normal((2, 1, 64, 2, 8)).astype(np.float32)
    q = rng.standard_normal((1, 64, 2, 8)).astype(np.float32)
    portakern.attention(q[:, :2], cache[0, :, :2], cache[1, :, :2], causal=True)
    before = made()
    for L in range(3, 64, 7):    # views of a preallocated cache (strides stay), queries of every prompt length
        k, v = cache[0, :, :L], cache[1, :, :L]
        out = portakern.attention(q[:, :L], k, v, causal=True)
        np.testing.assert_allclose(out, reference(q[:, :L], k, v, causal=True), rtol=2e-5, atol=2e-6)
    assert made() == before


def test_varlen_and_paged_lengths_share_plans(rng, limits):
    H, D = 2, 8
    before = made()
    for lens in ([3, 5], [4, 9], [7, 2]):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
        k = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
        v = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
        out = portakern.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        np.testing.assert_allclose(out, reference(q, k, v, True, cu, cu), rtol=2e-5, atol=2e-6)
    assert made() - before == 1
    pool = rng.standard_normal((2, 8, 4, H, D)).astype(np.float32)     # 8 pages of 4 keys
    q = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    before = made()
    for L in range(1, 17):       # the block table grows a page every 4 keys
        pages = -(-L // 4)
        table = np.arange(7, 7 - pages, -1, dtype=np.int32)[None]
        out = portakern.attention(q, pool[0], pool[1], block_table=table, seqlens_k=np.array([L], np.int32))
        dense = pool[:, table[0]].reshape(2, 1, pages * 4, H, D)[:, :, :L]
        np.testing.assert_allclose(out, reference(q, dense[0], dense[1]), rtol=2e-5, atol=2e-6)
    assert made() - before == 2          # the block table of one page and of more


def test_k_and_v_of_different_lengths_are_still_refused(rng, limits):
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 9, 2, 8)).astype(np.float32)
    portakern.attention(q, k[:, :5], k[:, :5])
    with pytest.raises(InvalidInputError, match="v"):
        portakern.attention(q, k[:, :6], k[:, :7])


def test_the_plan_cache_is_a_bounded_lru(rng, limits):
    assert dispatch.set_cache_limits(plans=2)["plans"] == 2
    calls = [tuple(rng.standard_normal((1, 1, 2, d)).astype(np.float32) for _ in range(3)) for d in (8, 16, 32)]
    before = made()
    portakern.attention(*calls[0])
    portakern.attention(*calls[1])
    portakern.attention(*calls[0])                    # used again: calls[1] is now the least recent
    portakern.attention(*calls[2])                    # evicts calls[1]
    info = dispatch.cache_info()
    assert (info["plans"], info["plan_evictions"], made() - before) == (2, 1, 3)
    portakern.attention(*calls[0])                    # still cached
    assert made() - before == 3
    out = portakern.attention(*calls[1])              # planned afresh, right values
    assert made() - before == 4
    np.testing.assert_allclose(out, reference(*calls[1]), rtol=2e-5, atol=2e-6)


def test_empty_results_are_bounded_too(rng, limits):
    dispatch.set_cache_limits(empty_results=1)
    for d in (8, 16):
        portakern.attention(*(np.zeros((1, 0 if a == 0 else 2, 2, d), np.float32) for a in range(3)))
    assert dispatch.cache_info()["empty_results"] == 1


@pytest.mark.parametrize("bounds, error, fragment", [
    ({"plans": 0}, InvalidInputError, r"plans=0 must be >= 1"),
    ({"lengths": 2.5}, InvalidTypeError, r"lengths=2.5 must be an int"),
    ({"empty_results": True}, InvalidTypeError, r"empty_results=True must be an int"),
], ids=["zero", "float", "bool"])
def test_bad_cache_limits_name_the_bound(bounds, error, fragment, limits):
    with pytest.raises(error, match=fragment):
        dispatch.set_cache_limits(**bounds)


# -- a backend whose kernels are compiled per length --------------------------------------------

class PerLength(Backend):
    """Runs the cpu reference kernel but, like a GPU backend, specialises its kernel on the lengths (no
    ``runtime_lengths``); counts compiles; refuses keys longer than ``max_sk``."""

    name = "per-length"
    array_kind = "numpy"
    device_types = ("cpu",)
    priority = 100

    def __init__(self, max_sk=10**9):
        self.max_sk, self.compiled = max_sk, []

    def supports(self, op, device):
        return YES if op.seqlen_k <= self.max_sk else no(f"seqlen_k={op.seqlen_k} > {self.max_sk}")

    def compile(self, op, device):
        self.compiled.append((op.seqlen_q, op.seqlen_k))
        inner = CpuBackend().compile(op, device)

        def kernel(q, k, v, out, lse, aux):
            assert k.shape[1] == op.seqlen_k, "a kernel ran at a length it was not compiled for"
            inner(q, k, v, out, lse, aux)
        return kernel


class Provides:
    def __init__(self, *backends):
        self.backends = backends

    @hookimpl
    def portakern_register_backends(self):
        return list(self.backends)


def test_a_backend_compiling_per_length_decides_once_and_compiles_each_length_once(rng, register_plugin, limits):
    be = PerLength()
    register_plugin(Provides(be), name="per-length")
    dispatch.set_cache_limits(lengths=4)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((2, 1, 12, 2, 8)).astype(np.float32)
    before = made()
    for L in (2, 3, 4, 3, 2, 5, 6, 7, 4):
        out = portakern.attention(q, kv[0, :, :L], kv[1, :, :L])
        np.testing.assert_allclose(out, reference(q, kv[0, :, :L], kv[1, :, :L]), rtol=2e-5, atol=2e-6)
    assert made() - before == 1
    # 2 with the plan; 3..7 once each; 4 again after the LRU of 4 lengths dropped it (its last use was oldest)
    assert be.compiled == [(1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 4)]
    d = portakern.explain(portakern.attention, q, kv[0, :, :7], kv[1, :, :7])
    assert d.chosen == "per-length" and d.op.seqlen_k == 7 and d.lengths_compiled == 6
    assert d.plan_ms is not None and d.compile_ms is not None
    assert "6 more length(s) compiled" in str(d)


def test_a_length_the_chosen_backend_refuses_falls_back(rng, register_plugin, limits):
    be = PerLength(max_sk=4)
    register_plugin(Provides(be), name="per-length")
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((2, 1, 8, 2, 8)).astype(np.float32)
    portakern.attention(q, kv[0, :, :3], kv[1, :, :3])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = portakern.attention(q, kv[0, :, :6], kv[1, :, :6])
    np.testing.assert_allclose(out, reference(q, kv[0, :, :6], kv[1, :, :6]), rtol=2e-5, atol=2e-6)
    assert any(issubclass(w.category, FallbackWarning) and "seqlen_k=6 > 4" in str(w.message) for w in seen)
    portakern.attention(q, kv[0, :, :3], kv[1, :, :3], backend="per-length")  # forced: no fallback allowed
    with pytest.raises(BackendError, match=r"per-length.*forced by argument.*seqlen_k=6 > 4"):
        portakern.attention(q, kv[0, :, :6], kv[1, :, :6], backend="per-length")


# -- explain: the plan that ran ----------------------------------------------------------------

class FailsToRun(PerLength):
    name = "fails-to-run"

    def compile(self, op, device):
        def kernel(*args):
            raise RuntimeError("launch failed")
        return kernel


def test_explain_after_a_runtime_fallback_shows_what_ran(rng, register_plugin, limits):
    register_plugin(Provides(FailsToRun()), name="fails")
    q, k, v = (rng.standard_normal((1, 2, 2, 8)).astype(np.float32) for _ in range(3))
    before = portakern.explain(portakern.attention, q, k, v)
    assert before.chosen == "fails-to-run" and before.plan_ms is None and "not planned yet" in str(before)
    with pytest.warns(FallbackWarning):
        out = portakern.attention(q, k, v)
    np.testing.assert_allclose(out, reference(q, k, v), rtol=2e-5, atol=2e-6)
    after = portakern.explain(portakern.attention, q, k, v)
    assert after.chosen != "fails-to-run" and after.chosen is not None
    assert [b for b, _ in after.fallbacks] == ["fails-to-run"] and "launch failed" in after.fallbacks[0][1]
    assert "fell back from fails-to-run" in str(after) and f"* {after.chosen}" in str(after)
    assert after.plan_ms >= 0 and after.compile_ms >= 0 and "planned in" in str(after)
    assert after.to_json()["plan_ms"] == after.plan_ms


def test_a_transformers_generate_loop_plans_once_per_shape_class(limits):
    """The loop of issue 45: transformers' DynamicCache grows k/v (B, H, S, D) by one key a step and hands portakern
    transposed views, whose strides change with S; a new prompt length and every decode step reuse the plans."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import portakern.integrations.transformers  # noqa: F401  (registers attn_implementation="portakern")

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="portakern").eval()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)        # prefill (Sq >= 2) and decode (Sq = 1)
        before = made()
        model.generate(ids[:, :4], max_new_tokens=16, do_sample=False)
    assert made() == before


def opencl_programs() -> int:
    from portakern.backends.opencl.common import program

    return len(program._programs)


def test_opencl_serves_every_length_with_one_program(rng, limits):
    """The opencl attention kernel takes the lengths as arguments (``runtime_lengths``): a growing dense loop
    makes one plan per class and one program, with the reference values at every length."""
    from opencl_helpers import require_opencl

    require_opencl()
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((2, 1, 12, 2, 8)).astype(np.float32)
    before, compiled = made(), dispatch.cache_info()["lengths_compiled"]
    programs = opencl_programs()
    for L in range(2, 12):
        k, v = kv[0, :, :L], kv[1, :, :L]
        out = portakern.attention(q, k, v, backend="opencl")
        np.testing.assert_allclose(out, reference(q, k, v), rtol=1e-4, atol=1e-5, err_msg=f"Sk={L}")
    assert made() - before == 1 and dispatch.cache_info()["lengths_compiled"] == compiled
    assert opencl_programs() - programs <= 1          # 0 when an earlier test built the same program
    d = portakern.explain(portakern.attention, q, kv[0, :, :11], kv[1, :, :11], backend="opencl")
    assert d.chosen == "opencl" and d.lengths_compiled == 0


def test_opencl_paged_and_varlen_loops_build_no_program_per_length(rng, limits):
    """A block table that widens (its width is the kernel's row stride, an argument) and varlen sequences that
    grow (one query row each: the work-group's rows stay) reuse their programs; values at every step."""
    from opencl_helpers import require_opencl

    require_opencl()
    H, D, P = 2, 8, 4
    pool = rng.standard_normal((2, 10, P, H, D)).astype(np.float32)
    q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
    portakern.attention(q, pool[0], pool[1], block_table=np.array([[9, 8], [1, 2]], np.int32),
                        seqlens_k=np.array([5, 6], np.int32), backend="opencl")
    before, programs = made(), opencl_programs()
    for L in range(6, 21):      # widths 2..5 pages; the second sequence one key longer
        pages = -(-(L + 1) // P)
        table = np.stack([np.arange(9, 9 - pages, -1), np.arange(1, 1 + pages) % 10]).astype(np.int32)
        lens = np.array([L, L + 1], np.int32)
        out = portakern.attention(q, pool[0], pool[1], block_table=table, seqlens_k=lens, backend="opencl")
        for b in range(2):
            dense = pool[:, table[b]].reshape(2, 1, pages * P, H, D)[:, :, :lens[b]]
            np.testing.assert_allclose(out[b:b + 1], reference(q[b:b + 1], dense[0], dense[1]), rtol=1e-4,
                                       atol=1e-5, err_msg=f"paged L={L} b={b}")
    assert made() == before and opencl_programs() == programs
    qv = rng.standard_normal((2, H, D)).astype(np.float32)
    kv = rng.standard_normal((2, 40, H, D)).astype(np.float32)
    cu_q = np.array([0, 1, 2], np.int32)
    before = made()
    for step in range(10):      # decode over varlen keys: each sequence gains a key a step
        cu_k = np.array([0, 5 + step, 12 + 2 * step], np.int32)
        k, v = kv[0, :cu_k[-1]], kv[1, :cu_k[-1]]
        out = portakern.attention(qv, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="opencl")
        np.testing.assert_allclose(out, reference(qv, k, v, False, cu_q, cu_k), rtol=1e-4, atol=1e-5,
                                   err_msg=f"varlen step {step}")
        if step == 0:
            programs = opencl_programs()
    assert made() - before == 1 and opencl_programs() == programs
