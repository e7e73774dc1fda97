"""Empty batches: an attention q without query rows (B or Sq 0; total_q 0 for varlen) and a quant_gemv x of zero rows
give empty results of the caller's array type, device and dtype without a kernel, after the checks any other call
gets (shapes, options, the backend name, a forced backend's supports() for the one-row problem); the checks run
once per signature (so the call can be captured in a CUDA graph), index values on the host every call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from error_helpers import rejects
from portakern.errors import InvalidInputError, InvalidTypeError, UnsupportedError
from portakern.quantize import quantize

F32 = np.float32


def rand(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)



# -- attention ------------------------------------------------------------------------------------------------------

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


def test_cached_empty_torch_results_follow_each_call(fresh_registry):
    q = torch.zeros(0, 3, 4, 8, dtype=torch.float16)
    k = torch.ones(0, 5, 2, 8, dtype=torch.float16)
    for _ in range(2):
        out, lse = portakern.attention(q, k, k, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == (0, 3, 4, 8)
        assert lse.dtype == torch.float32 and lse.shape == (0, 4, 3)


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


def test_explain_names_an_empty_q(fresh_registry):
    rejects(lambda: portakern.explain(portakern.attention, rand(0, 4, 2, 8), rand(0, 4, 2, 8), rand(0, 4, 2, 8)),
            InvalidInputError, "q has shape (0, 4, 2, 8)", "batch=0", "no kernel to run or explain")


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


# -- quant_gemv -----------------------------------------------------------------------------------------------------

@pytest.fixture
def weight():
    w = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    return quantize(w, bits=4, group_size=32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_empty_batch_gives_empty_rows(weight, dtype):
    out = portakern.quant_gemv(np.zeros((0, 64), dtype), weight)
    assert isinstance(out, np.ndarray) and out.shape == (0, 8) and out.dtype == dtype


def test_empty_batch_with_the_silu_mul_prologue_has_n_columns(weight):
    out = portakern.quant_gemv(np.zeros((0, 128), np.float32), weight, prologue="silu_mul")
    assert out.shape == (0, 8)


def test_torch_empty_batch_matches_the_torch_op(weight):
    torch = pytest.importorskip("torch")
    x = torch.zeros((0, 64), dtype=torch.bfloat16)
    out = portakern.quant_gemv(x, weight)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 8) and out.dtype == torch.bfloat16


def test_empty_batch_still_checks_k(weight):
    with pytest.raises(InvalidInputError, match=r"x has K=63 columns but w is \(8, 64\)"):
        portakern.quant_gemv(np.zeros((0, 63), np.float32), weight)


def test_empty_batch_still_checks_dtype_and_weight(weight):
    with pytest.raises(InvalidTypeError, match="x has dtype int32"):
        portakern.quant_gemv(np.zeros((0, 64), np.int32), weight)
    with pytest.raises(InvalidTypeError, match="expected a portakern.QuantizedWeight"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), np.zeros((8, 64), np.float32))


def test_empty_batch_still_checks_the_backend_name(weight):
    with pytest.raises((InvalidInputError, UnsupportedError), match="no-such-backend"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), weight, backend="no-such-backend")
    with pytest.raises(InvalidTypeError, match="must be a backend name"):
        portakern.quant_gemv(np.zeros((0, 64), np.float32), weight, backend=3)


def test_a_batch_of_rows_still_computes(weight):
    x = np.linspace(-2, 2, 2 * 64, dtype=np.float32).reshape(2, 64)
    want = x.astype(np.float64) @ np.asarray(weight.dequantize(), np.float64).T
    np.testing.assert_allclose(portakern.quant_gemv(x, weight), want, rtol=1e-5, atol=1e-5)


def test_empty_batch_still_checks_a_backend_forced_by_the_environment(weight, monkeypatch):
    # PORTAKERN_BACKEND naming no backend fails a batch of rows; an empty batch used to return (0, N) regardless
    monkeypatch.setenv("PORTAKERN_BACKEND", "no-such-backend")
    for rows in (1, 0):
        with pytest.raises(InvalidInputError, match="backend='no-such-backend' is not registered"):
            portakern.quant_gemv(np.zeros((rows, 64), np.float32), weight)


@pytest.mark.parametrize("rows", [1, 0])
def test_empty_batch_is_refused_by_a_forced_backend_that_cannot_run_it(weight, register_plugin, rows):
    # an empty batch used to return (0, N) from a forced backend whose supports() refuses the problem
    from portakern.backend import Backend, no
    from plugin_helpers import provides

    class Picky(Backend):
        name, array_kind, device_types = "picky", "numpy", ("cpu",)

        def supports(self, op, device):
            return no(f"group_size={op.fmt.group_size} must be 128; requantize")

    register_plugin(provides(Picky()), name="picky")
    x = np.zeros((rows, 64), np.float32)
    with pytest.raises(UnsupportedError, match=r"not supported by picky on cpu.*group_size=32 must be 128.*"
                                               r"pass backend='cpu'") as info:
        portakern.quant_gemv(x, weight, backend="picky")
    assert ("checked as its problem with one row" in str(info.value)) == (rows == 0)
    assert portakern.quant_gemv(x, weight, backend="cpu").shape == (rows, 8)


def test_empty_batch_is_checked_once_per_signature(weight, monkeypatch, fresh_registry):
    from portakern import api, dispatch

    calls = []
    real = api.quant_gemv_op
    monkeypatch.setattr(api, "quant_gemv_op", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = np.zeros((0, 64), np.float32)
    a, b = portakern.quant_gemv(x, weight), portakern.quant_gemv(x.copy(), weight)
    assert len(calls) == 1 and a.shape == b.shape == (0, 8) and a.dtype == np.float32 and a is not b
    portakern.quant_gemv(np.zeros((0, 64), np.float16), weight)   # another signature
    assert len(calls) == 2
    dispatch.clear_cache()
    portakern.quant_gemv(x, weight)
    assert len(calls) == 3
