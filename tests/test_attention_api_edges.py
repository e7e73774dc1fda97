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


# -- numbers too large for a float or for the index math -----------------------------------------------

@pytest.mark.parametrize("option", ["scale", "softcap"])
def test_an_int_too_large_for_a_float_is_an_invalid_input(fresh_registry, option):
    rejects(lambda: portakern.attention(Q, Q, Q, **{option: 10 ** 400}), InvalidInputError,
            f"{option}=1000", "must be a finite")


@pytest.mark.parametrize("window", [(0, 2 ** 63 - 1), (2 ** 63, 0), (0, 2 ** 31 - 1), (2 ** 30 + 1, 0)])
def test_a_window_side_past_2_30_is_rejected_not_wrapped(fresh_registry, window):
    # (0, 2**63 - 1) wrapped in the reference's int64 position math, (0, 2**31 - 1) in Triton's int32 one:
    # both hid every key right of the diagonal
    rejects(lambda: portakern.attention(Q, Q, Q, window=window), InvalidInputError,
            f"window={window!r}", "at most 1073741824", "-1")


def test_the_largest_window_side_is_unbounded_in_effect(fresh_registry):
    q, k, v = rand(1, 5, 4, 8, seed=1), rand(1, 9, 2, 8, seed=2), rand(1, 9, 2, 8, seed=3)
    for window in [(0, 2 ** 30), (2 ** 30, 0), (2 ** 30, 2 ** 30)]:
        got = portakern.attention(q, k, v, window=window, backend="cpu")
        np.testing.assert_allclose(got, attention64(q, k, v, window), rtol=2e-6, atol=2e-6)


# -- paged lengths: a negative length is named as such ---------------------------------------------------

def test_a_negative_paged_length_is_named_with_its_index(fresh_registry):
    k = v = rand(4, 4, 2, 8)
    msg = rejects(lambda: portakern.attention(rand(2, 1, 2, 8), k, v, block_table=np.zeros((2, 2), np.int32),
                                              seqlens_k=np.array([4, -1], np.int32)),
                  InvalidInputError, "seqlens_k[1]=-1", ">= 0")
    assert "longer" not in msg  # it used to call the longest valid length (4) too long


# -- empty dimensions: no query rows give empty results; anything else empty is named, with the way out ------

@pytest.mark.parametrize("q, k, v, lse_shape", [
    (rand(0, 4, 2, 8), rand(0, 4, 2, 8), rand(0, 4, 2, 16), (0, 2, 4)),
    (rand(3, 0, 2, 8), rand(3, 4, 1, 8), rand(3, 4, 1, 8), (3, 2, 0)),
], ids=["batch", "seqlen_q"])
def test_no_query_rows_give_empty_results(fresh_registry, q, k, v, lse_shape):
    out, lse = portakern.attention(q, k, v, return_lse=True)
    assert isinstance(out, np.ndarray) and out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == lse_shape and lse.dtype == np.float32
    assert portakern.attention(q, k, v, causal=True).shape == out.shape


def test_no_query_rows_keep_the_array_type_device_and_dtype(fresh_registry):
    torch = pytest.importorskip("torch")
    q = torch.zeros(0, 1, 4, 8, dtype=torch.bfloat16)
    k = torch.ones(0, 5, 2, 8, dtype=torch.bfloat16)
    out = portakern.attention(q, k, k)
    assert isinstance(out, torch.Tensor) and out.shape == (0, 1, 4, 8) and out.dtype == torch.bfloat16
    # paged: a batch of 0 with its (0, max_pages) block table and (0,) lengths
    pages = torch.ones(3, 4, 2, 8, dtype=torch.bfloat16)
    out = portakern.attention(q, pages, pages, block_table=torch.zeros(0, 2, dtype=torch.int32),
                              seqlens_k=torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 1, 4, 8)
    # the torch op follows the API
    from portakern import torch_ops

    assert torch_ops.attention_op(q, k, k).shape == (0, 1, 4, 8)


def test_no_varlen_query_rows_give_empty_results(fresh_registry):
    out, lse = portakern.attention(rand(0, 2, 8), rand(4, 1, 8), rand(4, 1, 8), return_lse=True,
                                   cu_seqlens_q=np.array([0, 0, 0], np.int32),
                                   cu_seqlens_k=np.array([0, 1, 4], np.int32))
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


@pytest.mark.parametrize("call, fragments", [
    (lambda: portakern.attention(rand(0, 4, 2, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)),
     ["k has batch 1 but q has batch 0"]),
    (lambda: portakern.attention(rand(0, 4, 4, 8), rand(0, 4, 3, 8), rand(0, 4, 3, 8)),
     ["q has 4 heads and k has 3"]),
    (lambda: portakern.attention(rand(0, 4, 2, 8), rand(0, 4, 2, 8), rand(0, 4, 2, 8), scale=float("nan")),
     ["scale=nan must be a finite non-zero number"]),
    (lambda: portakern.attention(rand(0, 4, 2, 8), rand(0, 4, 2, 8), rand(0, 4, 2, 8), backend="nope"),
     ["backend='nope' is not registered"]),
    (lambda: portakern.attention(rand(2, 0, 2, 8), rand(2, 4, 2, 8), rand(2, 4, 2, 8),
                                 seqlens_k=np.array([1, 9], np.int32)),
     ["seqlens_k=[1, 9] must lie in [0, 4]"]),
], ids=["batch-mismatch", "heads", "scale", "backend", "seqlens_k"])
def test_no_query_rows_are_checked_like_any_call(fresh_registry, call, fragments):
    rejects(call, InvalidInputError, *fragments)


@pytest.mark.parametrize("batch", [1, 0], ids=["rows", "no-rows"])
def test_no_query_rows_still_check_a_backend_forced_by_the_environment(fresh_registry, monkeypatch, batch):
    # an empty q used to return empty results although PORTAKERN_BACKEND names no backend
    monkeypatch.setenv("PORTAKERN_BACKEND", "nope")
    q = rand(batch, 4, 2, 8)
    rejects(lambda: portakern.attention(q, q, q), InvalidInputError, "backend='nope' is not registered",
            "registered backends are")


def test_explain_names_an_empty_q(fresh_registry):
    rejects(lambda: portakern.explain(portakern.attention, rand(0, 4, 2, 8), rand(0, 4, 2, 8), rand(0, 4, 2, 8)),
            InvalidInputError, "q has shape (0, 4, 2, 8)", "batch=0", "no kernel to run or explain")


@pytest.mark.parametrize("q, k, fragments", [
    (rand(1, 4, 2, 8), rand(1, 0, 2, 8), ["k has shape (1, 0, 2, 8)", "seqlen_k=0 must be a positive int",
                                          "seqlens_k"]),
    (rand(1, 4, 0, 8), rand(1, 4, 1, 8), ["q has shape (1, 4, 0, 8)", "heads (Hq) = 0"]),
    (rand(0, 4, 2, 0), rand(0, 4, 2, 0), ["head_dim (D) = 0"]),
], ids=["seqlen_k", "heads", "head_dim-of-empty-q"])
def test_an_empty_dense_dimension_names_the_argument(fresh_registry, q, k, fragments):
    rejects(lambda: portakern.attention(q, k, k), InvalidInputError, *fragments)


def test_empty_varlen_keys_name_the_argument(fresh_registry):
    rejects(lambda: portakern.attention(rand(4, 2, 8), rand(0, 2, 8), rand(0, 2, 8),
                                        cu_seqlens_q=np.array([0, 4], np.int32),
                                        cu_seqlens_k=np.array([0, 0], np.int32)),
            InvalidInputError, "k has shape (0, 2, 8)", "total_k=0", "use zeros")


def test_a_block_table_of_no_pages_names_the_argument(fresh_registry):
    k = v = rand(4, 4, 2, 8)
    rejects(lambda: portakern.attention(rand(1, 3, 2, 8), k, v, block_table=np.zeros((1, 0), np.int32),
                                        seqlens_k=np.array([0], np.int32)),
            InvalidInputError, "block_table has shape (1, 0)", "max_pages=0", "at least one page")


# -- numpy views with negative strides reach a torch backend -------------------------------------------------

class _TorchKind:
    name, array_kind = "torch-kind", "torch"


def _odd_row_stride(a):
    """A view of ``a``'s values whose rows are 2 bytes apart more than the elements' size allows."""
    rows, cols = a.shape
    buf = np.zeros(rows * (cols * a.itemsize + 2), np.uint8)
    view = np.ndarray((rows, cols), a.dtype, buffer=buf, strides=(cols * a.itemsize + 2, a.itemsize))
    view[...] = a
    return view


@pytest.mark.parametrize("make", [lambda: rand(2, 5, 3, 8)[:, ::-1], lambda: _odd_row_stride(rand(6, 8))],
                         ids=["negative_stride", "stride_not_a_multiple_of_itemsize"])
def test_a_numpy_view_torch_cannot_wrap_converts_for_a_torch_backend(make):
    a = make()
    t = convert_for_backend(a, _TorchKind(), CPU)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), a)


def test_a_negative_stride_view_runs_on_a_torch_backend(fresh_registry):
    if "torch-eager" not in {b.name for b in portakern.list_backends()}:
        pytest.skip("the example torch-eager plugin is not installed")
    q, k, v = rand(1, 6, 4, 8, seed=4)[:, ::-1], rand(1, 7, 2, 8, seed=5), rand(1, 7, 2, 8, seed=6)[:, ::-1]
    got = portakern.attention(q, k, v, backend="torch-eager")
    np.testing.assert_allclose(got, attention64(q, k, v), rtol=2e-5, atol=2e-5)


# -- numpy booleans are booleans -------------------------------------------------------------------------

def test_numpy_bools_for_causal_and_return_lse_act_like_python_bools(fresh_registry):
    # they used to be rejected with the self-contradicting 'causal=np.True_ must be True or False'
    q, k, v = rand(1, 5, 4, 8, seed=7), rand(1, 9, 2, 8, seed=8), rand(1, 9, 2, 8, seed=9)
    out, lse = portakern.attention(q, k, v, causal=np.bool_(True), return_lse=np.bool_(True), backend="cpu")
    np.testing.assert_allclose(out, attention64(q, k, v, window=(-1, 0)), rtol=2e-6, atol=2e-6)
    assert lse.shape == (1, 4, 5) and lse.dtype == np.float32
    plain = portakern.attention(q, k, v, causal=np.bool_(False), return_lse=np.bool_(False))
    np.testing.assert_allclose(plain, attention64(q, k, v), rtol=2e-6, atol=2e-6)


# -- dtype errors carry the way out ----------------------------------------------------------------------

@pytest.mark.parametrize("call, fragments", [
    (lambda: portakern.attention(Q.astype(np.float64), Q.astype(np.float64), Q.astype(np.float64)),
     ["q has dtype float64", "float16, bfloat16 or float32", "cast q to one of them"]),
    (lambda: portakern.attention(torch.from_numpy(Q), torch.from_numpy(Q).to(torch.int32), torch.from_numpy(Q)),
     ["k has dtype int32", "cast k to one of them"]),
    (lambda: portakern.attention(Q, Q, Q, seqlens_k=np.array([4], np.int16)),
     ["seqlens_k has dtype int16", "int32 or int64", "convert seqlens_k to one of them"]),
    (lambda: portakern.attention(Q, rand(2, 4, 2, 8), rand(2, 4, 2, 8), block_table=np.zeros((1, 1), np.float32),
                                 seqlens_k=np.array([4], np.int32)),
     ["block_table has dtype float32", "int32 or int64", "convert block_table to one of them"]),
], ids=["q_float64", "k_int32_torch", "seqlens_k_int16", "block_table_float32"])
def test_a_dtype_error_says_what_to_convert(fresh_registry, call, fragments):
    rejects(call, InvalidTypeError, *fragments)


def test_a_last_dimension_strided_by_an_odd_byte_count_is_not_contiguous(fresh_registry):
    rec = np.zeros((1, 4, 2, 8), dtype=[("a", F32), ("b", np.int16)])
    rec["a"] = Q  # a field view: float32 values 6 bytes apart, which used to pass as stride 6 // 4 = 1
    rejects(lambda: portakern.attention(rec["a"], Q, Q), InvalidInputError,
            "q has a stride of 6 bytes in its last (head_dim) dimension", "must be contiguous",
            "numpy.ascontiguousarray(q)")


# -- explain takes exactly the arguments of the op it explains ----------------------------------------

def test_explain_rejects_what_attention_rejects(fresh_registry):
    with pytest.raises(TypeError) as direct:
        portakern.attention(Q, Q, Q, window_size=(1, 0))
    rejects(lambda: portakern.explain(portakern.attention, Q, Q, Q, window_size=(1, 0)), InvalidTypeError,
            "window_size", "portakern.attention")
    assert "window_size" in str(direct.value)
    # a keyword of the internal validator is not an attention argument: it used to skip the index checks
    cu = np.array([0, 9], np.int32)
    rejects(lambda: portakern.explain("attention", Q[0], Q[0], Q[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      check_values=False), InvalidTypeError, "check_values")
    with pytest.raises(InvalidInputError, match="must start at 0, never decrease and end at 4"):
        portakern.explain("attention", Q[0], Q[0], Q[0], cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_explain_checks_the_backend_argument_as_attention_does(fresh_registry):
    want = rejects(lambda: portakern.attention(Q, Q, Q, backend=3), InvalidTypeError, "backend=3", "a str")
    assert rejects(lambda: portakern.explain(portakern.attention, Q, Q, Q, backend=3), InvalidTypeError) == want


@pytest.mark.parametrize("kw, fragment", [(dict(scale=1e39), r"scale=1e\+39 is outside float32"),
                                          (dict(scale=-1e-39), "scale=-1e-39 is outside float32"),
                                          (dict(softcap=1e-40), "softcap=1e-40 is outside float32"),
                                          (dict(softcap=1e39), r"softcap=1e\+39 is outside float32")])
def test_a_scale_or_softcap_float32_cannot_hold_is_refused(kw, fragment):
    """The kernels compute in float32: a scale of 1e39 is inf there (NaN scores) while the float64 reference used
    it; before, such values were accepted."""
    q = np.ones((1, 2, 2, 8), np.float32)
    with pytest.raises(InvalidInputError, match=fragment):
        portakern.attention(q, q, q, **kw)
    portakern.attention(q, q, q, scale=1e-30, softcap=0)          # in range: runs


@pytest.mark.parametrize("batch", [1, 0], ids=["rows", "no-rows"])
def test_no_query_rows_are_refused_by_a_forced_backend_that_cannot_run_them(register_plugin, batch):
    # an empty q used to return empty results from a forced backend whose supports() refuses the problem
    from portakern.backend import Backend, no
    from portakern.errors import UnsupportedError
    from plugin_helpers import provides

    class Picky(Backend):
        name, array_kind, device_types = "picky", "numpy", ("cpu",)

        def supports(self, op, device):
            return no(f"head_dim={op.head_dim} must be 128; pad the head dimension")

    register_plugin(provides(Picky()), name="picky")
    q = rand(batch, 4, 2, 8)
    msg = rejects(lambda: portakern.attention(q, q, q, backend="picky"), UnsupportedError,
                  "not supported by picky on cpu", "head_dim=8 must be 128", "pass backend='cpu'")
    assert ("checked as its problem with one row" in msg) == (batch == 0)
    with portakern.use_backend("picky"):
        rejects(lambda: portakern.attention(q, q, q, return_lse=True), UnsupportedError, "head_dim=8 must be 128")
    # the backend that can run it still gives the empty results
    assert portakern.attention(q, q, q, backend="cpu").shape == q.shape


def test_no_query_rows_are_checked_once_per_signature_off_the_cpu_index_path(fresh_registry, monkeypatch):
    # the checks of an empty call ran on every call (host reads of CUDA index arrays, no graph capture): now once per
    # signature, like a plan; a new signature, a cleared cache or a forced backend checks again
    from portakern import api, dispatch

    calls = []
    real = api.attention_op
    monkeypatch.setattr(api, "attention_op", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = rand(0, 4, 2, 8)
    first = portakern.attention(q, q, q, return_lse=True)
    again = portakern.attention(rand(0, 4, 2, 8), q, q, return_lse=True)
    assert len(calls) == 1
    assert [a.shape for a in again] == [a.shape for a in first] == [(0, 4, 2, 8), (0, 2, 4)]
    assert again[0] is not first[0]                     # fresh arrays each call
    portakern.attention(rand(0, 5, 2, 8), q, q)          # another signature (Sq 5)
    portakern.attention(q, q, q, backend="cpu")          # another override
    assert len(calls) == 3
    dispatch.clear_cache()
    portakern.attention(q, q, q, return_lse=True)
    assert len(calls) == 4


def test_no_query_rows_on_the_cpu_recheck_index_values_every_call(fresh_registry):
    # as for a call with rows: on the host, index values are checked on every call, not only the first
    q, k = rand(2, 0, 2, 8), rand(2, 4, 2, 8)
    assert portakern.attention(q, k, k, seqlens_k=np.array([1, 4], np.int32)).shape == (2, 0, 2, 8)
    rejects(lambda: portakern.attention(q, k, k, seqlens_k=np.array([1, 9], np.int32)), InvalidInputError,
            "seqlens_k=[1, 9] must lie in [0, 4]")


def test_cached_empty_torch_results_follow_each_call(fresh_registry):
    q = torch.zeros(0, 3, 4, 8, dtype=torch.float16)
    k = torch.ones(0, 5, 2, 8, dtype=torch.float16)
    for _ in range(2):
        out, lse = portakern.attention(q, k, k, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == (0, 3, 4, 8)
        assert lse.dtype == torch.float32 and lse.shape == (0, 4, 3)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # an empty call launches nothing, by design
def test_an_empty_paged_call_on_cuda_is_captured_in_a_graph_after_its_first_call(fresh_registry):
    # its checks read seqlens_k / block_table on the host; they ran on every call, so a capture failed
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: the CPU tests check that the checks run once per signature")
    dev = torch.device("cuda")
    q = torch.zeros(2, 0, 4, 64, dtype=torch.float16, device=dev)
    pages = torch.ones(3, 16, 2, 64, dtype=torch.float16, device=dev)
    aux = dict(block_table=torch.zeros(2, 2, dtype=torch.int32, device=dev),
               seqlens_k=torch.tensor([5, 20], dtype=torch.int32, device=dev))
    portakern.attention(q, pages, pages, return_lse=True, **aux)        # first call: checked, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = portakern.attention(q, pages, pages, return_lse=True, **aux)
    graph.replay()
    torch.cuda.synchronize()
    assert out.shape == (2, 0, 4, 64) and out.device.type == "cuda" and lse.shape == (2, 4, 0)
