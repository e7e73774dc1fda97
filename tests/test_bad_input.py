"""Bad input: every public entry point rejects it before launching anything, with an error that
is a portakern error *and* the builtin a caller expects, and a message naming the argument,
the value and the rule."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import portakern
from portakern.devices import parse_device
from portakern.errors import InvalidInputError, InvalidTypeError, PortakernError, UnsupportedError
from portakern.ir import Packing, QuantFormat
from portakern.ir import expr as E

F32 = np.float32


def arr(*shape, dtype=F32):
    return np.zeros(shape, dtype=dtype)


def qkv(B=2, Sq=3, Sk=8, Hq=4, Hkv=2, D=16, Dv=None, dtype=F32):
    return arr(B, Sq, Hq, D, dtype=dtype), arr(B, Sk, Hkv, D, dtype=dtype), arr(B, Sk, Hkv, Dv or D, dtype=dtype)


def paged(block_table, seqlens, pages=4, page=4, B=2, table_dtype=np.int32):
    """Paged attention with a pool of ``pages`` pages of ``page`` keys."""
    q = arr(B, 1, 4, 16)
    k = v = arr(pages, page, 2, 16)
    return lambda: portakern.attention(q, k, v, block_table=np.asarray(block_table, table_dtype),
                                       seqlens_k=np.asarray(seqlens, np.int32))


def varlen(cu_q, cu_k, total_q=5, total_k=9, **kw):
    q, k, v = arr(total_q, 4, 16), arr(total_k, 2, 16), arr(total_k, 2, 16)
    return lambda: portakern.attention(q, k, v, cu_seqlens_q=None if cu_q is None else np.asarray(cu_q, np.int32),
                                       cu_seqlens_k=None if cu_k is None else np.asarray(cu_k, np.int32), **kw)


def att(**kw) -> Callable[[], Any]:
    q, k, v = qkv()
    return lambda: portakern.attention(q, k, v, **kw)


def att_with(q=None, k=None, v=None, **kw) -> Callable[[], Any]:
    dq, dk, dv = qkv()
    return lambda: portakern.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kw)


def weight(N=16, K=64, bits=4, group_size=32):
    return portakern.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(F32), bits=bits,
                              group_size=group_size)


def gemv(x, w=None) -> Callable[[], Any]:
    return lambda: portakern.quant_gemv(x, weight() if w is None else w)


T = torch.zeros
CASES = [
    # -- array types, dtypes, devices ---------------------------------------------------------------
    ("q_is_a_list", att_with(q=[[1.0]]), InvalidTypeError, "q is a builtins.list: expected a numpy array"),
    ("q_int32", att_with(q=arr(2, 3, 4, 16, dtype=np.int32)), InvalidTypeError,
     "q has dtype int32: attention inputs must be float16, bfloat16 or float32"),
    ("v_float64", att_with(v=arr(2, 8, 2, 16, dtype=np.float64)), InvalidTypeError, "v has dtype float64"),
    ("qk_dtypes_differ", att_with(k=arr(2, 8, 2, 16, dtype=np.float16)), InvalidTypeError,
     "q, k, v dtypes differ (float32, float16, float32): cast them to one dtype"),
    ("mixed_numpy_torch", att_with(k=T(2, 8, 2, 16)), InvalidTypeError,
     "k is a torch array but q is a numpy array: mixed array libraries are not allowed"),
    ("index_array_other_library", lambda: portakern.attention(*qkv(), seqlens_k=T(2, dtype=torch.int32)),
     InvalidTypeError, "seqlens_k is a torch array but q is a numpy array"),
    ("meta_device", lambda: portakern.attention(T(1, 2, 2, 8, device="meta"), T(1, 2, 2, 8, device="meta"),
                                                T(1, 2, 2, 8, device="meta")),
     InvalidTypeError, "torch device meta is not supported: use a cpu or cuda tensor"),
    ("absent_device", lambda: parse_device("cuda:7"),
     InvalidInputError, "device='cuda:7' is not present on this machine"),
    ("block_table_float", paged([[0, 1], [2, 3]], [4, 4], table_dtype=F32), InvalidTypeError,
     "block_table has dtype float32: index arrays must be int32 or int64"),
    # -- shapes and head layout ---------------------------------------------------------------------
    ("q_3d_dense", att_with(q=arr(3, 4, 16)), InvalidInputError,
     "q has shape (3, 4, 16): expected 4 dimensions, (B, S, H, D)"),
    ("head_dim_mismatch", att_with(k=arr(2, 8, 2, 32)), InvalidInputError,
     "k head_dim 32 != q head_dim 16: q and k must share head_dim"),
    ("k_v_disagree", att_with(v=arr(2, 7, 2, 16)), InvalidInputError,
     "k shape (2, 8, 2, 16) and v shape (2, 7, 2, 16) must agree in all but the last dimension"),
    ("head_ratio", att_with(k=arr(2, 8, 3, 16), v=arr(2, 8, 3, 16)), InvalidInputError,
     "q has 4 heads and k has 3: the number of query heads must be a multiple of the number of KV heads"),
    ("batch_mismatch", att_with(k=arr(3, 8, 2, 16), v=arr(3, 8, 2, 16)), InvalidInputError,
     "k has batch 3 but q has batch 2: they must match"),
    ("empty_keys", att_with(k=arr(2, 0, 2, 16), v=arr(2, 0, 2, 16)), InvalidInputError,
     "seqlen_k=0 must be a positive int"),
    ("non_contiguous_numpy", att_with(q=arr(2, 3, 4, 32)[..., ::2]), InvalidInputError,
     "q has stride 2 in its last (head_dim) dimension: the innermost dimension must be contiguous"),
    ("non_contiguous_torch", lambda: portakern.attention(T(1, 2, 16, 2).transpose(-1, -2), T(1, 2, 2, 16),
                                                         T(1, 2, 2, 16)),
     InvalidInputError, "pass q.contiguous()"),
    # -- options --------------------------------------------------------------------------------------
    ("causal_not_bool", att(causal="yes"), InvalidTypeError, "causal='yes' must be True or False"),
    ("window_one_value", att(window=(3,)), InvalidInputError, "window=(3,) must be a (left, right) pair of ints"),
    ("window_float", att(window=(1.5, 0)), InvalidInputError, "window=(1.5, 0) must be a (left, right) pair"),
    ("softcap_negative", att(softcap=-1.0), InvalidInputError, "softcap=-1.0 must be a finite number >= 0"),
    ("softcap_string", att(softcap="30"), InvalidInputError, "softcap='30' must be a finite number"),
    ("scale_zero", att(scale=0.0), InvalidInputError, "scale=0.0 must be a finite non-zero number"),
    ("scale_nan", att(scale=float("nan")), InvalidInputError, "scale=nan must be a finite non-zero number"),
    ("scale_string", att(scale="0.1"), InvalidInputError, "scale='0.1' must be a finite non-zero number"),
    ("score_mod_string", att(score_mod="score * 2"), InvalidTypeError,
     "score_mod='score * 2' must be a portakern.ir.Expr"),
    ("score_mod_boolean", att(score_mod=E.kv_idx < 3), InvalidInputError,
     "is a boolean expression: pass masks as mask_mod"),
    ("mask_mod_numeric", att(mask_mod=E.kv_idx + 1), InvalidInputError,
     "is not a boolean expression: it must say which keys are kept"),
    ("mask_mod_reads_score", att(mask_mod=E.score > 0), InvalidInputError,
     "mask_mod reads 'score': masks may depend on positions and heads only"),
    ("return_lse_not_bool", att(return_lse=1), InvalidTypeError, "return_lse=1 must be True or False"),
    ("unknown_expr_variable", lambda: E.var("token"), InvalidInputError,
     "expression variable 'token' is unknown: expected one of score, b, h"),
    # -- paged KV --------------------------------------------------------------------------------------
    ("paged_without_seqlens", lambda: portakern.attention(arr(2, 1, 4, 16), arr(4, 4, 2, 16), arr(4, 4, 2, 16),
                                                          block_table=np.zeros((2, 2), np.int32)),
     InvalidInputError, "paged attention (block_table given) needs seqlens_k"),
    ("block_table_out_of_range", paged([[0, 7], [1, 2]], [8, 8]), InvalidInputError,
     "block_table[0] references page 7 but k has 4 pages (valid 0..3)"),
    ("block_table_negative", paged([[0, 1], [-1, 2]], [8, 8]), InvalidInputError,
     "block_table[1] references page -1"),
    ("seqlens_longer_than_table", paged([[0, 1], [2, 3]], [8, 9]), InvalidInputError,
     "seqlens_k has a value 9 longer than the block table holds (2 pages x page_size 4 = 8 keys)"),
    ("block_table_wrong_batch", paged([[0, 1]], [4, 4]), InvalidInputError,
     "block_table has shape (1, 2): expected (batch, max_pages) = (2, max_pages)"),
    ("paged_seqlens_wrong_shape", paged([[0, 1], [2, 3]], [4, 4, 4]), InvalidInputError,
     "seqlens_k has shape (3,): expected (batch,) = (2,)"),
    # -- dense lengths, varlen -------------------------------------------------------------------------
    ("dense_seqlens_too_long", att(seqlens_k=np.array([3, 9], np.int32)), InvalidInputError,
     "seqlens_k=[3, 9] must lie in [0, 8]"),
    ("varlen_needs_both", varlen([0, 2, 5], None), InvalidInputError,
     "varlen attention needs both cu_seqlens_q and cu_seqlens_k"),
    ("cu_seqlens_not_monotone", varlen([0, 4, 2, 5], [0, 3, 6, 9]), InvalidInputError,
     "cu_seqlens_q=[0, 4, 2, 5]... must start at 0, never decrease and end at 5"),
    ("cu_seqlens_wrong_end", varlen([0, 2, 5], [0, 3, 8]), InvalidInputError,
     "cu_seqlens_k=[0, 3, 8]... must start at 0, never decrease and end at 9 (the first dimension of k)"),
    ("cu_seqlens_wrong_shape", varlen([0, 2, 5], [[0, 3, 9]]), InvalidInputError,
     "cu_seqlens_k has shape (1, 3): expected (batch + 1,) = (3,)"),
    ("varlen_with_seqlens_k", varlen([0, 2, 5], [0, 3, 9], seqlens_k=np.array([3, 6], np.int32)),
     InvalidInputError, "seqlens_k must be None for varlen attention"),
    ("varlen_with_block_table", varlen([0, 2, 5], [0, 3, 9], block_table=np.zeros((2, 1), np.int32)),
     InvalidInputError, "block_table together with cu_seqlens_q/k is not supported"),
    # -- backends and dispatch ---------------------------------------------------------------------------
    ("unknown_backend", att(backend="tpu"), InvalidInputError,
     "backend='tpu' is not registered: registered backends are"),
    ("use_backend_not_a_string", lambda: portakern.use_backend(3).__enter__(), InvalidInputError,
     "use_backend(3): the backend name must be a string"),
    ("explain_unknown_fn", lambda: portakern.explain(len, *qkv()), InvalidTypeError,
     "fn must be portakern.attention or portakern.quant_gemv"),
    ("mask_mod_not_an_expr", att(mask_mod="causal"), InvalidTypeError,
     "mask_mod='causal' must be a portakern.ir.Expr (see portakern.ir.expr)"),
    ("dense_seqlens_k_wrong_length", att(seqlens_k=np.array([8, 8, 8], np.int32)), InvalidInputError,
     "seqlens_k has shape (3,): expected (batch,) = (2,)"),
    # -- quantized GEMV -----------------------------------------------------------------------------------
    ("weight_not_quantized", gemv(arr(1, 64), arr(16, 64)), InvalidTypeError,
     "w is a ndarray: expected a portakern.QuantizedWeight"),
    ("x_int8", gemv(arr(1, 64, dtype=np.int8)), InvalidTypeError,
     "x has dtype int8: activations must be float16, bfloat16 or float32"),
    ("x_1d", gemv(arr(64)), InvalidInputError, "x has shape (64,): expected (M, K) = (M, 64); reshape a vector"),
    ("x_wrong_k", gemv(arr(2, 48)), InvalidInputError, "x has K=48 columns but w is (16, 64): x must be (M, 64)"),
    ("x_non_contiguous", gemv(arr(2, 128)[:, ::2]), InvalidInputError, "x has stride 2 in its last"),
    ("x_is_a_list", gemv([[0.0] * 64]), InvalidTypeError, "x is a builtins.list"),
    ("group_size_not_dividing_k", lambda: weight(K=64, group_size=48), InvalidInputError,
     "group_size=48 does not divide K=64"),
    ("bits_unsupported_by_packing", lambda: QuantFormat(bits=3, group_size=32, symmetric=False).verify(),
     InvalidInputError, "bits=3 is not supported by packing native"),
    ("gguf_group_size", lambda: QuantFormat(4, 64, True, Packing.GGUF_Q4_0).verify(K=128), InvalidInputError,
     "group_size=64 must be 32 for gguf_q4_0"),
    ("awq_n_not_multiple_of_8", lambda: QuantFormat(4, 32, False, Packing.AWQ).verify(K=64, N=12),
     InvalidInputError, "N=12 must be a multiple of 8 for awq"),
    ("gptq_symmetric", lambda: QuantFormat(4, 32, True, Packing.GPTQ).verify(), InvalidInputError,
     "symmetric=True is not a gptq layout"),
]


@pytest.mark.parametrize("call, exc, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_teaching_message(fresh_registry, call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    err = info.value
    assert isinstance(err, PortakernError), f"{type(err).__name__} is not a PortakernError"
    builtin = ValueError if issubclass(exc, InvalidInputError) else TypeError if issubclass(exc, InvalidTypeError) \
        else NotImplementedError
    assert isinstance(err, builtin)
    assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_forced_backend_that_cannot_run_here(fresh_registry, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedError, match="is not supported by triton on cpu.*pass backend='cpu'") as e:
        portakern.attention(*qkv(), backend="triton")
    assert isinstance(e.value, NotImplementedError)


def test_nothing_launches_before_validation(register_plugin):
    """A kernel never sees bad input: validation runs before compile and launch."""
    launched = []

    class Spy(portakern.Backend):
        name, array_kind, priority = "spy", "numpy", 99

        def supports(self, op, device):
            return portakern.Support(True)

        def compile(self, op, device):
            launched.append("compile")
            return lambda *a: launched.append("run")

    class Plugin:
        @portakern.hookimpl
        def portakern_register_backends(self):
            return [Spy()]

    register_plugin(Plugin(), name="spy")
    q, k, v = qkv()
    with pytest.raises(InvalidInputError, match=r"window=\(1, 2, 3\) must be a \(left, right\) pair"):
        portakern.attention(q, k, v, window=(1, 2, 3))
    with pytest.raises(InvalidInputError, match="the number of query heads must be a multiple"):
        portakern.attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    assert launched == []
