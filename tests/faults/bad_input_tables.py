"""The bad-input tables of tests/faults/test_fault_bad_inputs.py: per public API, ``(id, call, error type, fragments)``
where the fragments are what the message must hold -- the argument, the value, the rule and the way out.

``python tests/faults/bad_input_tables.py [api]`` prints every case's error type and message (to read them all).
"""

from __future__ import annotations

import numpy as np
import torch

import portakern
from portakern.errors import InvalidInputError as BadValue, InvalidTypeError as BadType, UnsupportedError
from portakern.ir import expr as E
from portakern.quantized import QuantizedWeight

F32 = np.float32


def z(*shape, dtype=F32):
    return np.zeros(shape, dtype=dtype)


def r(*shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


Q, K, V = r(2, 3, 4, 16), r(2, 8, 2, 16), r(2, 8, 2, 16)


_D = object()   # "the default array"


def att(q=_D, k=_D, v=_D, **kw):
    return lambda: portakern.attention(Q if q is _D else q, K if k is _D else k, V if v is _D else v, **kw)


def paged(table, lens, table_dtype=np.int32, lens_dtype=np.int32, **kw):
    kp = vp = z(4, 4, 2, 16)
    return lambda: portakern.attention(z(2, 1, 4, 16), kp, vp, block_table=np.asarray(table, table_dtype),
                                       seqlens_k=np.asarray(lens, lens_dtype), **kw)


def varlen(cu_q, cu_k, **kw):
    q, k = z(5, 4, 16), z(9, 2, 16)
    return lambda: portakern.attention(q, k, k, cu_seqlens_q=None if cu_q is None else np.asarray(cu_q, np.int32),
                                       cu_seqlens_k=None if cu_k is None else np.asarray(cu_k, np.int32), **kw)


TQ = torch.from_numpy(Q)

ATTENTION = [
    # array types
    ("q-list", att(q=[[1.0]]), BadType, ["q is a builtins.list", "expected a numpy array"]),
    ("q-none", att(q=None), BadType, ["q is a builtins.NoneType", "expected a numpy array"]),
    ("k-float", att(k=1.5), BadType, ["k is a builtins.float", "expected a numpy array"]),
    ("v-dict", att(v={"v": V}), BadType, ["v is a builtins.dict", "expected a numpy array"]),
    ("k-torch-q-numpy", att(k=torch.from_numpy(K)), BadType,
     ["k is a torch array but q is a numpy array", "mixed array libraries are not allowed"]),
    ("meta-device", lambda: portakern.attention(*(torch.zeros(1, 2, 2, 8, device="meta"),) * 3), BadType,
     ["q: torch device meta is not supported", "use a cpu or cuda tensor"]),
    ("q-masked", att(q=np.ma.masked_array(Q)), BadType, ["q is a numpy masked array", "np.ma.filled(q, fill)"]),
    ("q-sparse", lambda: portakern.attention(TQ.to_sparse(), TQ, TQ), BadType,
     ["q is a torch tensor with layout=torch.sparse_coo", "q.to_dense()"]),
    # dtypes
    ("q-int32", att(q=z(2, 3, 4, 16, dtype=np.int32)), BadType,
     ["q has dtype int32", "float16, bfloat16 or float32"]),
    ("q-float64", att(q=z(2, 3, 4, 16, dtype=np.float64)), BadType,
     ["q has dtype float64", "float16, bfloat16 or float32"]),
    ("k-bool", att(k=K > 0), BadType, ["k has dtype bool", "float16, bfloat16 or float32"]),
    ("q-complex", lambda: portakern.attention(*(TQ.to(torch.complex64),) * 3), BadType,
     ["q has dtype complex64", "float16, bfloat16 or float32"]),
    ("dtypes-differ", att(k=K.astype(np.float16)), BadType,
     ["q, k, v dtypes differ (float32, float16, float32)", "cast them to one dtype"]),
    # shapes and heads
    ("q-3d-dense", att(q=z(3, 4, 16)), BadValue, ["q has shape (3, 4, 16)", "expected 4 dimensions, (B, S, H, D)"]),
    ("q-5d", att(q=z(1, 2, 3, 4, 16)), BadValue, ["q has shape (1, 2, 3, 4, 16)", "4 dimensions"]),
    ("head-dim-mismatch", att(k=z(2, 8, 2, 32)), BadValue, ["k head_dim 32 != q head_dim 16", "must share"]),
    ("k-v-disagree", att(v=z(2, 7, 2, 16)), BadValue,
     ["k shape (2, 8, 2, 16) and v shape (2, 7, 2, 16)", "must agree in all but the last dimension"]),
    ("head-ratio", att(k=z(2, 8, 3, 16), v=z(2, 8, 3, 16)), BadValue,
     ["q has 4 heads and k has 3", "must be a multiple of the number of KV heads"]),
    ("batch-mismatch", att(k=z(3, 8, 2, 16), v=z(3, 8, 2, 16)), BadValue,
     ["k has batch 3 but q has batch 2", "must match"]),
    ("empty-keys", att(k=z(2, 0, 2, 16), v=z(2, 0, 2, 16)), BadValue, ["seqlen_k=0", "must be a positive int"]),
    ("hkv-zero", att(k=z(2, 8, 0, 16), v=z(2, 8, 0, 16)), BadValue, ["k has shape (2, 8, 0, 16)", "must be >= 1"]),
    ("q-strided", att(q=z(2, 3, 4, 32)[..., ::2]), BadValue,
     ["q has stride 2 in its last (head_dim) dimension", "contiguous"]),
    # options
    ("causal-str", att(causal="yes"), BadType, ["causal='yes'", "must be True or False"]),
    ("causal-none", att(causal=None), BadType, ["causal=None", "must be True or False"]),
    ("causal-int", att(causal=2), BadType, ["causal=2", "must be True or False"]),
    ("window-one", att(window=(3,)), BadValue, ["window=(3,)", "(left, right) pair of ints"]),
    ("window-float", att(window=(1.5, 0)), BadValue, ["window=(1.5, 0)", "(left, right) pair"]),
    ("window-int", att(window=5), BadValue, ["window=5", "(left, right) pair"]),
    ("window-str", att(window="1,1"), BadValue, ["window='1,1'", "(left, right) pair"]),
    ("window-bool", att(window=(True, 1)), BadValue, ["window=(True, 1)", "(left, right) pair of ints"]),
    ("window-too-wide", att(window=(2 ** 31, 0)), BadValue, ["window=(2147483648, 0)", "2**30"]),
    ("softcap-negative", att(softcap=-1.0), BadValue, ["softcap=-1.0", "must be a finite number >= 0"]),
    ("softcap-str", att(softcap="30"), BadValue, ["softcap='30'", "must be a finite number >= 0"]),
    ("softcap-inf", att(softcap=float("inf")), BadValue, ["softcap=inf", "must be a finite number >= 0"]),
    ("scale-zero", att(scale=0.0), BadValue, ["scale=0.0", "must be a finite non-zero number"]),
    ("scale-nan", att(scale=float("nan")), BadValue, ["scale=nan", "must be a finite non-zero number"]),
    ("scale-str", att(scale="0.1"), BadValue, ["scale='0.1'", "must be a finite non-zero number"]),
    ("scale-complex", att(scale=1j), BadValue, ["scale=1j", "must be a finite non-zero number"]),
    ("scale-too-large", att(scale=1e39), BadValue, ["scale=1e+39", "float32"]),
    ("score-mod-str", att(score_mod="score * 2"), BadType, ["score_mod='score * 2'", "must be a portakern.ir.Expr"]),
    ("score-mod-boolean", att(score_mod=E.kv_idx < 3), BadValue, ["boolean expression", "pass masks as mask_mod"]),
    ("mask-mod-numeric", att(mask_mod=E.kv_idx + 1), BadValue, ["is not a boolean expression",
                                                                "it must say which keys are kept"]),
    ("mask-mod-reads-score", att(mask_mod=E.score > 0), BadValue,
     ["mask_mod reads 'score'", "masks may depend on positions and heads only"]),
    ("return-lse-int", att(return_lse=1), BadType, ["return_lse=1", "must be True or False"]),
    ("return-lse-str", att(return_lse="yes"), BadType, ["return_lse='yes'", "must be True or False"]),
    ("backend-int", att(backend=3), BadType, ["backend=3", "must be a backend name (a str) or None",
                                              "portakern.list_backends()"]),
    ("backend-unknown", att(backend="tpu"), BadValue, ["backend='tpu' is not registered",
                                                       "registered backends are"]),
    ("backend-empty", att(backend=""), BadValue, ["backend='' is not a backend name", "registered backends are",
                                                  "backend=None to let dispatch choose"]),
    # paged, lengths, varlen
    ("paged-without-seqlens", lambda: portakern.attention(z(2, 1, 4, 16), z(4, 4, 2, 16), z(4, 4, 2, 16),
                                                          block_table=np.zeros((2, 2), np.int32)),
     BadValue, ["block_table given", "needs seqlens_k"]),
    ("block-table-out-of-range", paged([[0, 7], [1, 2]], [8, 8]), BadValue,
     ["block_table[0] references page 7", "valid 0..3"]),
    ("block-table-float", paged([[0, 1], [2, 3]], [4, 4], table_dtype=F32), BadType,
     ["block_table has dtype float32", "index arrays must be int32 or int64"]),
    ("seqlens-longer-than-table", paged([[0, 1], [2, 3]], [8, 9]), BadValue,
     ["seqlens_k has a value 9 longer than the block table holds"]),
    ("seqlens-float", att(seqlens_k=np.array([3.0, 4.0], F32)), BadType,
     ["seqlens_k has dtype float32", "int32 or int64"]),
    ("seqlens-too-long", att(seqlens_k=np.array([3, 9], np.int32)), BadValue, ["seqlens_k=[3, 9]", "[0, 8]"]),
    ("seqlens-negative", att(seqlens_k=np.array([-1, 4], np.int32)), BadValue, ["seqlens_k=[-1, 4]", "[0, 8]"]),
    ("seqlens-wrong-length", att(seqlens_k=np.array([8, 8, 8], np.int32)), BadValue,
     ["seqlens_k has shape (3,)", "expected (batch,) = (2,)"]),
    ("varlen-needs-both", varlen([0, 2, 5], None), BadValue, ["needs both cu_seqlens_q and cu_seqlens_k"]),
    ("cu-seqlens-decreasing", varlen([0, 4, 2, 5], [0, 3, 6, 9]), BadValue,
     ["cu_seqlens_q=[0, 4, 2, 5]", "must start at 0, never decrease and end at 5"]),
    ("cu-seqlens-wrong-end", varlen([0, 2, 5], [0, 3, 8]), BadValue,
     ["cu_seqlens_k=[0, 3, 8]", "end at 9 (the first dimension of k)"]),
]


_W = {}


def weight(N=16, K=64, bits=4, group_size=32):
    """A quantized (N, K) weight (made once per shape)."""
    key = (N, K, bits, group_size)
    if key not in _W:
        _W[key] = portakern.quantize(r(N, K, seed=1), bits=bits, group_size=group_size)
    return _W[key]


def gemv(x=_D, w=_D, **kw):
    return lambda: portakern.quant_gemv(r(2, 64) if x is _D else x, weight() if w is _D else w, **kw)


QUANT_GEMV = [
    # x: array type, dtype, shape, layout
    ("x-list", gemv(x=[[0.0] * 64]), BadType, ["x is a builtins.list", "expected a numpy array"]),
    ("x-none", gemv(x=None), BadType, ["x is a builtins.NoneType", "expected a numpy array"]),
    ("x-str", gemv(x="x"), BadType, ["x is a builtins.str", "expected a numpy array"]),
    ("x-float", gemv(x=1.0), BadType, ["x is a builtins.float", "expected a numpy array"]),
    ("x-int8", gemv(x=z(2, 64, dtype=np.int8)), BadType, ["x has dtype int8", "float16, bfloat16 or float32",
                                                                   "convert x to one of them first"]),
    ("x-int64", gemv(x=z(2, 64, dtype=np.int64)), BadType, ["x has dtype int64", "convert x to one of them"]),
    ("x-float64", gemv(x=z(2, 64, dtype=np.float64)), BadType, ["x has dtype float64", "convert x to one of them"]),
    ("x-bool", gemv(x=r(2, 64) > 0), BadType, ["x has dtype bool", "float16, bfloat16 or float32"]),
    ("x-complex", gemv(x=torch.ones(2, 64, dtype=torch.complex64)), BadType, ["x has dtype complex64"]),
    ("x-object", gemv(x=np.zeros((2, 64), object)), BadType, ["x has dtype object", "float16, bfloat16 or float32"]),
    ("x-masked", gemv(x=np.ma.masked_array(r(2, 64))), BadType, ["x is a numpy masked array", "np.ma.filled(x, fill)"]),
    ("x-sparse", gemv(x=torch.from_numpy(r(2, 64)).to_sparse()), BadType,
     ["x is a torch tensor with layout=torch.sparse_coo", "x.to_dense()"]),
    ("x-meta", gemv(x=torch.zeros(2, 64, device="meta")), BadType, ["x: torch device meta is not supported"]),
    ("x-0d", gemv(x=np.float32(1.0)), BadValue, ["x has shape ()", "expected (M, K) = (M, 64)"]),
    ("x-1d", gemv(x=z(64)), BadValue, ["x has shape (64,)", "expected (M, K) = (M, 64)", "reshape a vector"]),
    ("x-3d", gemv(x=z(1, 2, 64)), BadValue, ["x has shape (1, 2, 64)", "expected (M, K) = (M, 64)"]),
    ("x-wrong-k", gemv(x=z(2, 48)), BadValue, ["x has K=48 columns but w is (16, 64)", "x must be (M, 64)"]),
    ("x-k-zero", gemv(x=z(2, 0)), BadValue, ["x has K=0 columns but w is (16, 64)", "x must be (M, 64)"]),
    ("x-transposed", gemv(x=z(64, 2).T), BadValue, ["x has stride", "in its last (K) dimension", "contiguous"]),
    ("x-strided", gemv(x=z(2, 128)[:, ::2]), BadValue, ["x has stride 2 in its last (K) dimension"]),
    ("x-reversed", gemv(x=z(2, 64)[:, ::-1]), BadValue, ["x has stride -1 in its last (K) dimension"]),
    ("silu-mul-wrong-k", gemv(x=z(2, 64), prologue="silu_mul"), BadValue,
     ["prologue='silu_mul'", "x must be (M, 2 * 64) = (M, 128)"]),
    # w
    ("w-ndarray", gemv(w=z(16, 64)), BadType, ["w is a ndarray", "expected a portakern.QuantizedWeight",
                                                 "portakern.quantize(w)"]),
    ("w-none", gemv(w=None), BadType, ["w is a NoneType", "expected a portakern.QuantizedWeight"]),
    ("w-list", gemv(w=[[0.0] * 64] * 16), BadType, ["w is a list", "portakern.quantize(w)"]),
    ("w-dict", gemv(w={"qweight": z(8, 16)}), BadType, ["w is a dict", "from_gguf/from_awq/from_gptq"]),
    ("w-torch", gemv(w=torch.zeros(16, 64)), BadType, ["w is a Tensor", "expected a portakern.QuantizedWeight"]),
    ("w-str", gemv(w="model.layers.0.mlp"), BadType, ["w is a str", "expected a portakern.QuantizedWeight"]),
    ("w-float", gemv(w=0.5), BadType, ["w is a float", "expected a portakern.QuantizedWeight"]),
    # options
    ("prologue-unknown", gemv(prologue="gelu"), BadValue, ["prologue='gelu'", "is not a quant_gemv prologue",
                                                           "use None or one of"]),
    ("prologue-int", gemv(prologue=1), BadValue, ["prologue=1", "use None or one of"]),
    ("prologue-empty", gemv(prologue=""), BadValue, ["prologue=''", "use None or one of"]),
    ("prologue-upper", gemv(prologue="SILU_MUL"), BadValue, ["prologue='SILU_MUL'", "use None or one of"]),
    ("backend-int", gemv(backend=1), BadType, ["backend=1", "must be a backend name (a str) or None"]),
    ("backend-list", gemv(backend=["cpu"]), BadType, ["backend=['cpu']", "must be a backend name (a str) or None"]),
    ("backend-unknown", gemv(backend="tpu"), BadValue, ["backend='tpu' is not registered", "registered backends are"]),
    ("backend-empty", gemv(backend=""), BadValue, ["backend='' is not a backend name",
                                                   "backend=None to let dispatch choose"]),
    ("backend-case", gemv(backend="CPU"), BadValue, ["backend='CPU' is not registered", "registered backends are"]),
    ("backend-bytes", gemv(backend=b"cpu"), BadType, ["backend=b'cpu'", "must be a backend name (a str) or None"]),
    ("backend-spaces", gemv(backend=" cpu"), BadValue, ["backend=' cpu' is not registered"]),
]


def quantize(w=_D, **kw):
    kw.setdefault("group_size", 32)
    return lambda: portakern.quantize(r(16, 64) if w is _D else w, **kw)


QUANTIZE = [
    # w
    ("w-list", quantize(w=[[0.0] * 64] * 16), BadType, ["w is a builtins.list", "expected a numpy array"]),
    ("w-none", quantize(w=None), BadType, ["w is a builtins.NoneType", "expected a numpy array"]),
    ("w-str", quantize(w="weights.bin"), BadType, ["w is a builtins.str", "expected a numpy array"]),
    ("w-int32", quantize(w=z(16, 64, dtype=np.int32)), BadType, ["w has dtype int32", "float"]),
    ("w-bool", quantize(w=r(16, 64) > 0), BadType, ["w has dtype bool", "float"]),
    ("w-complex", quantize(w=torch.ones(16, 64, dtype=torch.complex64)), BadType,
     ["w has dtype", "complex64", "float"]),
    ("w-object", quantize(w=np.zeros((16, 64), object)), BadType, ["w has dtype object", "float"]),
    ("w-masked", quantize(w=np.ma.masked_array(r(16, 64))), BadType, ["w is a numpy masked array"]),
    ("w-sparse", quantize(w=torch.from_numpy(r(16, 64)).to_sparse()), BadType, ["w.to_dense()"]),
    ("w-meta", quantize(w=torch.zeros(16, 64, device="meta")), BadType,
     ["w: torch device meta is not supported", "use a cpu or cuda tensor"]),
    ("w-0d", quantize(w=np.float32(1.0)), BadValue, ["w has shape ()", "(N, K)"]),
    ("w-1d", quantize(w=z(64)), BadValue, ["w has shape (64,)", "(N, K)"]),
    ("w-3d", quantize(w=z(2, 16, 64)), BadValue, ["w has shape (2, 16, 64)", "(N, K)"]),
    ("w-k0", quantize(w=z(16, 0)), BadValue, ["w has shape (16, 0)", "K >= 1"]),
    ("w-n0", quantize(w=z(0, 64)), BadValue, ["w has shape (0, 64)", "N >= 1"]),
    ("w-nan", quantize(w=np.where(np.arange(64) == 5, np.nan, 1.0).astype(F32)[None].repeat(16, 0)), BadValue,
     ["w", "nan"]),
    ("w-inf", quantize(w=np.where(np.arange(64) == 5, np.inf, 1.0).astype(F32)[None].repeat(16, 0)), BadValue,
     ["w", "inf"]),
    # bits
    ("bits-3", quantize(bits=3), BadValue, ["bits=3", "choose 4 or 8"]),
    ("bits-2", quantize(bits=2), BadValue, ["bits=2", "choose 4 or 8"]),
    ("bits-16", quantize(bits=16), BadValue, ["bits=16", "choose 4 or 8"]),
    ("bits-float", quantize(bits=4.0), BadValue, ["bits=4.0", "choose 4 or 8"]),
    ("bits-str", quantize(bits="4"), BadValue, ["bits='4'", "choose 4 or 8"]),
    ("bits-none", quantize(bits=None), BadValue, ["bits=None", "choose 4 or 8"]),
    ("bits-bool", quantize(bits=True), BadValue, ["bits=True", "choose 4 or 8"]),
    # group_size
    ("group-not-dividing", quantize(group_size=48), BadValue, ["group_size=48 does not divide K=64"]),
    ("group-zero", quantize(group_size=0), BadValue, ["group_size=0"]),
    ("group-one", quantize(group_size=1), BadValue, ["group_size=1"]),
    ("group-minus-two", quantize(group_size=-2), BadValue, ["group_size=-2"]),
    ("group-float", quantize(group_size=32.0), BadValue, ["group_size=32.0"]),
    ("group-str", quantize(group_size="32"), BadValue, ["group_size='32'"]),
    ("group-none", quantize(group_size=None), BadValue, ["group_size=None"]),
    ("group-bool", quantize(group_size=True), BadValue, ["group_size=True"]),
    ("group-larger-than-k", quantize(group_size=128), BadValue, ["group_size=128", "K=64"]),
    # symmetric, scale_dtype
    ("symmetric-str", quantize(symmetric="yes"), BadType, ["symmetric='yes'", "must be True or False"]),
    ("symmetric-int", quantize(symmetric=1), BadType, ["symmetric=1", "must be True or False"]),
    ("symmetric-none", quantize(symmetric=None), BadType, ["symmetric=None", "must be True or False"]),
    ("scale-dtype-float64", quantize(scale_dtype="float64"), BadValue,
     ["scale_dtype='float64' is not a scale dtype", "choose 'float16', 'bfloat16', 'float32'"]),
    ("scale-dtype-float8", quantize(scale_dtype="float8"), BadValue,
     ["scale_dtype='float8' is not a scale dtype", "choose 'float16'"]),
    ("scale-dtype-int", quantize(scale_dtype=16), BadValue,
     ["scale_dtype=16 is not a scale dtype", "choose 'float16'"]),
    ("scale-dtype-none", quantize(scale_dtype=None), BadValue,
     ["scale_dtype=None is not a scale dtype", "choose 'float16'"]),
    ("scale-dtype-int8", quantize(scale_dtype="int8"), BadValue,
     ["scale_dtype='int8' is not a scale dtype", "choose 'float16'"]),
]


def ex(fn, *args, **kw):
    return lambda: portakern.explain(fn, *args, **kw)


A, G = portakern.attention, portakern.quant_gemv
X = r(2, 64)

EXPLAIN = [
    # fn
    ("fn-len", ex(len, Q, K, V), BadType, ["explain(fn=<built-in function len>)",
                                           "fn must be portakern.attention or portakern.quant_gemv"]),
    ("fn-none", ex(None, Q, K, V), BadType, ["explain(fn=None)", "fn must be portakern.attention"]),
    ("fn-int", ex(3, Q, K, V), BadType, ["explain(fn=3)", "fn must be portakern.attention"]),
    ("fn-unknown-name", ex("softmax", Q, K, V), BadType, ["explain(fn='softmax')", "fn must be portakern.attention"]),
    ("fn-empty-name", ex("", Q, K, V), BadType, ["explain(fn='')", "fn must be portakern.attention"]),
    ("fn-quantize", ex(portakern.quantize, r(16, 64)), BadType, ["fn must be portakern.attention or "
                                                                  "portakern.quant_gemv"]),
    ("fn-torch-sdpa", ex(torch.nn.functional.scaled_dot_product_attention, Q, K, V), BadType,
     ["fn must be portakern.attention or portakern.quant_gemv"]),
    # the op's own signature
    ("attention-no-args", ex(A), BadType, ["explain(portakern.attention, ...)", "missing a required argument: 'q'",
                                           "pass the arguments of portakern.attention"]),
    ("attention-missing-v", ex(A, Q, K), BadType, ["missing a required argument: 'v'"]),
    ("attention-extra-positional", ex(A, Q, K, V, True), BadType, ["too many positional arguments",
                                                                  "pass the arguments of portakern.attention"]),
    ("attention-unknown-keyword", ex(A, Q, K, V, casual=True), BadType, ["unexpected keyword argument 'casual'",
                                                                        "pass the arguments of portakern.attention"]),
    ("attention-internal-keyword", ex(A, Q, K, V, check_values=False), BadType,
     ["unexpected keyword argument 'check_values'"]),
    ("gemv-no-w", ex(G, X), BadType, ["explain(portakern.quant_gemv, ...)", "missing a required argument: 'w'"]),
    ("gemv-by-name-unknown-keyword", ex("quant_gemv", X, weight(), bias=None), BadType,
     ["unexpected keyword argument 'bias'", "pass the arguments of portakern.quant_gemv"]),
    # what attention rejects
    ("attention-q-list", ex(A, [[1.0]], K, V), BadType, ["q is a builtins.list", "expected a numpy array"]),
    ("attention-q-int32", ex(A, z(2, 3, 4, 16, dtype=np.int32), K, V), BadType, ["q has dtype int32"]),
    ("attention-q-3d", ex(A, z(3, 4, 16), K, V), BadValue, ["q has shape (3, 4, 16)", "4 dimensions"]),
    ("attention-head-ratio", ex(A, Q, z(2, 8, 3, 16), z(2, 8, 3, 16)), BadValue, ["q has 4 heads and k has 3"]),
    ("attention-batch", ex(A, Q, z(3, 8, 2, 16), z(3, 8, 2, 16)), BadValue, ["k has batch 3 but q has batch 2"]),
    ("attention-causal-str", ex(A, Q, K, V, causal="yes"), BadType, ["causal='yes'", "must be True or False"]),
    ("attention-window", ex(A, Q, K, V, window=(3,)), BadValue, ["window=(3,)", "(left, right) pair"]),
    ("attention-softcap", ex(A, Q, K, V, softcap=-1.0), BadValue, ["softcap=-1.0", "finite number >= 0"]),
    ("attention-scale", ex(A, Q, K, V, scale=0.0), BadValue, ["scale=0.0", "finite non-zero number"]),
    ("attention-score-mod", ex(A, Q, K, V, score_mod="s"), BadType, ["score_mod='s'", "portakern.ir.Expr"]),
    ("attention-mask-mod", ex(A, Q, K, V, mask_mod=E.score > 0), BadValue, ["mask_mod reads 'score'"]),
    ("attention-return-lse", ex(A, Q, K, V, return_lse=1), BadType, ["return_lse=1", "must be True or False"]),
    ("attention-seqlens", ex(A, Q, K, V, seqlens_k=np.array([3, 9], np.int32)), BadValue, ["seqlens_k=[3, 9]"]),
    ("attention-block-table", ex(A, z(2, 1, 4, 16), z(4, 4, 2, 16), z(4, 4, 2, 16),
                                 block_table=np.zeros((2, 2), np.int32)), BadValue, ["needs seqlens_k"]),
    ("attention-varlen", ex(A, z(5, 4, 16), z(9, 2, 16), z(9, 2, 16), cu_seqlens_q=np.array([0, 2, 5], np.int32)),
     BadValue, ["needs both cu_seqlens_q and cu_seqlens_k"]),
    ("attention-backend-int", ex(A, Q, K, V, backend=3), BadType, ["backend=3", "must be a backend name"]),
    ("attention-backend-unknown", ex(A, Q, K, V, backend="tpu"), BadValue, ["backend='tpu' is not registered"]),
    ("attention-meta", ex(A, *(torch.zeros(1, 2, 2, 8, device="meta"),) * 3), BadType,
     ["q: torch device meta is not supported"]),
    # what quant_gemv rejects
    ("gemv-w-ndarray", ex(G, X, z(16, 64)), BadType, ["w is a ndarray", "expected a portakern.QuantizedWeight"]),
    ("gemv-x-int8", ex(G, z(2, 64, dtype=np.int8), weight()), BadType, ["x has dtype int8"]),
    ("gemv-x-1d", ex(G, z(64), weight()), BadValue, ["x has shape (64,)", "reshape a vector"]),
    ("gemv-x-wrong-k", ex(G, z(2, 48), weight()), BadValue, ["x has K=48 columns but w is (16, 64)"]),
    ("gemv-x-strided", ex(G, z(2, 128)[:, ::2], weight()), BadValue, ["x has stride 2 in its last (K) dimension"]),
    ("gemv-prologue", ex(G, X, weight(), prologue="gelu"), BadValue, ["prologue='gelu'", "use None or one of"]),
    ("gemv-backend-unknown", ex(G, X, weight(), backend="tpu"), BadValue, ["backend='tpu' is not registered"]),
    ("gemv-backend-list", ex(G, X, weight(), backend=["cpu"]), BadType, ["backend=['cpu']",
                                                                        "must be a backend name"]),
    ("gemv-x-masked", ex(G, np.ma.masked_array(X), weight()), BadType, ["x is a numpy masked array"]),
]


def awq(qweight=_D, qzeros=_D, scales=_D, group_size=32, N=16, K=64):
    """AWQ tensors of an (N, K) weight, any one replaced."""
    G_ = K // group_size if isinstance(group_size, int) and group_size > 0 and K % group_size == 0 else 2
    t = dict(qweight=z(K, N // 8, dtype=np.int32), qzeros=z(G_, N // 8, dtype=np.int32),
             scales=z(G_, N, dtype=np.float16))
    for name, val in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if val is not _D:
            t[name] = val
    return lambda: QuantizedWeight.from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size)


def gptq(qweight=_D, qzeros=_D, scales=_D, group_size=32, N=16, K=64, **kw):
    """GPTQ tensors of an (N, K) weight, any one replaced."""
    G_ = K // group_size if isinstance(group_size, int) and group_size > 0 and K % group_size == 0 else 2
    t = dict(qweight=z(K // 8, N, dtype=np.int32), qzeros=z(G_, N // 8, dtype=np.int32),
             scales=z(G_, N, dtype=np.float16))
    for name, val in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if val is not _D:
            t[name] = val
    return lambda: QuantizedWeight.from_gptq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size, **kw)


def gguf(data=_D, ggml_type="Q4_0", shape=(16, 64)):
    """A GGUF Q4_0 block array of a (16, 64) weight (18 bytes per 32 weights), any argument replaced."""
    d = z(16, 64 // 32 * 18, dtype=np.uint8) if data is _D else data
    return lambda: QuantizedWeight.from_gguf(d, ggml_type, shape)


QUANTIZED_WEIGHT = [
    # from_gguf
    ("gguf-type-unknown", gguf(ggml_type="Q3_K"), BadValue, ["ggml_type='Q3_K' is not supported",
                                                             "portakern.quantize(w)"]),
    ("gguf-type-int", gguf(ggml_type=99), BadValue, ["ggml_type=99 is not supported"]),
    ("gguf-type-none", gguf(ggml_type=None), BadValue, ["ggml_type=None is not supported"]),
    ("gguf-type-float", gguf(ggml_type=2.0), BadValue, ["ggml_type=2.0 is not supported"]),
    ("gguf-type-f16", gguf(ggml_type="F16"), BadValue, ["ggml_type='F16' is not supported"]),
    ("gguf-shape-zero", gguf(shape=(0, 64)), BadValue, ["shape=(0, 64)", "two positive ints (N, K)"]),
    ("gguf-shape-1d", gguf(shape=(64,)), BadValue, ["shape=(64,)", "two positive ints (N, K)"]),
    ("gguf-shape-3d", gguf(shape=(1, 16, 64)), BadValue, ["shape=(1, 16, 64)", "two positive ints (N, K)"]),
    ("gguf-shape-str", gguf(shape="16x64"), BadValue, ["shape='16x64'", "two positive ints (N, K)",
                                                         "numpy order"]),
    ("gguf-shape-bool", gguf(shape=(True, 64)), BadValue, ["shape=(True, 64)", "two positive ints (N, K)"]),
    ("gguf-shape-float", gguf(shape=(16.0, 64)), BadValue, ["shape=(16.0, 64)", "two positive ints (N, K)"]),
    ("gguf-shape-none", gguf(shape=None), BadValue, ["shape=None", "two positive ints (N, K)"]),
    ("gguf-k-not-block", gguf(shape=(16, 48)), BadValue, ["K=48 must be a multiple of 32 for Q4_0",
                                                          "reverse it"]),
    ("gguf-data-float", gguf(data=z(16, 36)), BadType, ["data has dtype float32", "uint8"]),
    ("gguf-data-int8", gguf(data=z(16, 36, dtype=np.int8)), BadType, ["data has dtype int8", "uint8"]),
    ("gguf-data-list", gguf(data=[0] * 576), BadType, ["data is a builtins.list", "expected a numpy array"]),
    ("gguf-data-none", gguf(data=None), BadType, ["data is a builtins.NoneType", "expected a numpy array"]),
    ("gguf-data-bytes", gguf(data=bytes(576)), BadType, ["data is a builtins.bytes", "expected a numpy array"]),
    ("gguf-data-short", gguf(data=z(16, 35, dtype=np.uint8)), BadValue,
     ["data has shape (16, 35) (560 bytes)", "needs N * K // 32 * 18 = 576 bytes", "check shape"]),
    ("gguf-data-q8-size", gguf(ggml_type="Q8_0"), BadValue, ["data has shape (16, 36)", "Q8_0", "34"]),
    # from_awq
    ("awq-qweight-float", awq(qweight=z(64, 2)), BadType, ["qweight", "float32", "int32"]),
    ("awq-qweight-1d", awq(qweight=z(128, dtype=np.int32)), BadValue, ["qweight has shape (128,)", "2-D (K, N // 8)"]),
    ("awq-qweight-list", awq(qweight=[[0, 0]] * 64), BadType, ["qweight is a builtins.list"]),
    ("awq-qweight-none", awq(qweight=None), BadType, ["qweight is a builtins.NoneType"]),
    ("awq-qzeros-shape", awq(qzeros=z(3, 2, dtype=np.int32)), BadValue, ["qzeros", "(3, 2)", "(2, 2)"]),
    ("awq-qzeros-float", awq(qzeros=z(2, 2)), BadType, ["qzeros", "float32", "int32"]),
    ("awq-scales-shape", awq(scales=z(2, 8, dtype=np.float16)), BadValue, ["scales", "(2, 8)", "(2, 16)"]),
    ("awq-scales-int", awq(scales=z(2, 16, dtype=np.int32)), BadType, ["scales", "int32", "float16"]),
    ("awq-group-not-dividing", awq(group_size=48), BadValue, ["group_size=48", "K=64"]),
    ("awq-group-zero", awq(group_size=0), BadValue, ["group_size=0"]),
    ("awq-group-str", awq(group_size="32"), BadValue, ["group_size='32'"]),
    ("awq-group-none", awq(group_size=None), BadValue, ["group_size=None"]),
    ("awq-group-float", awq(group_size=32.0), BadValue, ["group_size=32.0"]),
    ("awq-mixed-libraries", awq(scales=torch.zeros(2, 16, dtype=torch.float16)), BadType,
     ["is a torch array", "numpy", "convert them together"]),
    # from_gptq
    ("gptq-qweight-float", gptq(qweight=z(8, 16)), BadType, ["qweight", "float32", "int32"]),
    ("gptq-qweight-1d", gptq(qweight=z(128, dtype=np.int32)), BadValue, ["qweight has shape (128,)", "2-D"]),
    ("gptq-qzeros-shape", gptq(qzeros=z(2, 3, dtype=np.int32)), BadValue, ["qzeros", "(2, 3)", "(2, 2)"]),
    ("gptq-scales-shape", gptq(scales=z(3, 16, dtype=np.float16)), BadValue, ["scales", "(3, 16)", "(2, 16)"]),
    ("gptq-group-not-dividing", gptq(group_size=48), BadValue, ["group_size=48", "K=64"]),
    ("gptq-format-unknown", gptq(checkpoint_format="gptq_v3"), BadValue,
     ["checkpoint_format='gptq_v3'", "expected 'gptq'", "'gptq_v2'"]),
    ("gptq-format-none", gptq(checkpoint_format=None), BadValue, ["checkpoint_format=None", "expected 'gptq'"]),
    ("gptq-g-idx-shape", gptq(g_idx=np.zeros(32, np.int32)), BadValue, ["g_idx", "(32,)", "(64,)"]),
    ("gptq-g-idx-float", gptq(g_idx=np.zeros(64, F32)), BadType, ["g_idx", "float32"]),
    ("gptq-g-idx-out-of-range", gptq(g_idx=np.full(64, 5, np.int32)), BadValue, ["g_idx", "5"]),
    ("gptq-v2-zero-point-zero", gptq(checkpoint_format="gptq_v2"), BadValue, ["gptq_v2", "zero point"]),
]


def in_backend(name):
    return lambda: portakern.use_backend(name).__enter__()


def in_policy(name):
    return lambda: portakern.use_policy(name).__enter__()


def env_call(var, value):
    """A call of attention with environment variable ``var`` set to ``value`` (restored after)."""
    def call():
        import os

        saved = os.environ.get(var)
        os.environ[var] = value
        try:
            portakern.attention(Q, K, V)
        finally:
            if saved is None:
                del os.environ[var]
            else:
                os.environ[var] = saved
    return call


UNREGISTERED = ["registered backends are", "cpu"]

OVERRIDES = [
    # use_backend
    ("backend-int", in_backend(3), BadValue, ["use_backend(3)", "must be a string", "pass one of the registered names",
                                              "portakern.list_backends()"]),
    ("backend-none", in_backend(None), BadValue, ["use_backend(None)", "must be a string"]),
    ("backend-bytes", in_backend(b"cpu"), BadValue, ["use_backend(b'cpu')", "must be a string"]),
    ("backend-list", in_backend(["cpu"]), BadValue, ["use_backend(['cpu'])", "must be a string"]),
    ("backend-tuple", in_backend(("cpu",)), BadValue, ["use_backend(('cpu',))", "must be a string"]),
    ("backend-bool", in_backend(True), BadValue, ["use_backend(True)", "must be a string"]),
    ("backend-float", in_backend(1.0), BadValue, ["use_backend(1.0)", "must be a string"]),
    ("backend-object", in_backend(portakern.list_backends()[0]), BadValue,
     ["must be a string", "pass its name, use_backend('cpu')"]),
    ("backend-empty", in_backend(""), BadValue, ["backend=''", *UNREGISTERED]),
    ("backend-unknown", in_backend("tpu"), BadValue, ["backend='tpu' is not registered", *UNREGISTERED]),
    ("backend-case", in_backend("CPU"), BadValue, ["backend='CPU' is not registered", *UNREGISTERED]),
    ("backend-space", in_backend(" cpu"), BadValue, ["backend=' cpu' is not registered"]),
    ("backend-trailing-space", in_backend("cpu "), BadValue, ["backend='cpu ' is not registered"]),
    ("backend-comma-list", in_backend("cpu,triton"), BadValue, ["backend='cpu,triton' is not registered"]),
    ("backend-device-name", in_backend("cuda:0"), BadValue, ["backend='cuda:0' is not registered"]),
    ("backend-typo", in_backend("tirton"), BadValue, ["backend='tirton' is not registered"]),
    ("backend-env-unknown", env_call("PORTAKERN_BACKEND", "tpu"), BadValue,
     ["backend='tpu' is not registered (named by PORTAKERN_BACKEND='tpu')", *UNREGISTERED, "unset it"]),
    ("backend-env-case", env_call("PORTAKERN_BACKEND", "CPU"), BadValue,
     ["backend='CPU' is not registered (named by PORTAKERN_BACKEND='CPU')", "set PORTAKERN_BACKEND to one of them"]),
    ("backend-env-space", env_call("PORTAKERN_BACKEND", " cpu"), BadValue,
     ["backend=' cpu' is not registered (named by PORTAKERN_BACKEND=' cpu')"]),
    ("backend-env-list", env_call("PORTAKERN_BACKEND", "cpu,triton"), BadValue,
     ["backend='cpu,triton' is not registered (named by PORTAKERN_BACKEND='cpu,triton')"]),
    # use_policy
    ("policy-unknown", in_policy("fast"), BadValue, ["use_policy(name)='fast' is not a dispatch policy",
                                                     "the policies are", "'priority'", "'fastest'"]),
    ("policy-empty", in_policy(""), BadValue, ["use_policy(name)=''", "is not a dispatch policy"]),
    ("policy-none", in_policy(None), BadValue, ["use_policy(name)=None", "is not a dispatch policy"]),
    ("policy-int", in_policy(1), BadValue, ["use_policy(name)=1", "is not a dispatch policy"]),
    ("policy-bool", in_policy(True), BadValue, ["use_policy(name)=True", "is not a dispatch policy"]),
    ("policy-upper", in_policy("FASTEST"), BadValue, ["use_policy(name)='FASTEST'", "the policies are"]),
    ("policy-space", in_policy("fastest "), BadValue, ["use_policy(name)='fastest '", "the policies are"]),
    ("policy-list", in_policy(["fastest"]), BadValue, ["use_policy(name)=['fastest']", "the policies are"]),
    ("policy-bytes", in_policy(b"fastest"), BadValue, ["use_policy(name)=b'fastest'", "the policies are"]),
    ("policy-backend-name", in_policy("cpu"), BadValue, ["use_policy(name)='cpu'", "the policies are"]),
    ("policy-typo", in_policy("priorty"), BadValue, ["use_policy(name)='priorty'", "the policies are"]),
    ("policy-measured", in_policy("measured"), BadValue, ["use_policy(name)='measured'", "the policies are"]),
    ("policy-dict", in_policy({"policy": "fastest"}), BadValue, ["use_policy(name)={'policy': 'fastest'}"]),
    ("policy-float", in_policy(0.5), BadValue, ["use_policy(name)=0.5", "the policies are"]),
    ("policy-env-unknown", env_call("PORTAKERN_POLICY", "fast"), BadValue,
     ["PORTAKERN_POLICY='fast' is not a dispatch policy", "the policies are"]),
    ("policy-env-upper", env_call("PORTAKERN_POLICY", "FASTEST"), BadValue, ["PORTAKERN_POLICY='FASTEST'"]),
    ("policy-env-space", env_call("PORTAKERN_POLICY", " fastest"), BadValue, ["PORTAKERN_POLICY=' fastest'"]),
    ("policy-env-number", env_call("PORTAKERN_POLICY", "1"), BadValue, ["PORTAKERN_POLICY='1'"]),
    ("policy-env-backend-name", env_call("PORTAKERN_POLICY", "cpu"), BadValue, ["PORTAKERN_POLICY='cpu'"]),
    ("policy-env-typo", env_call("PORTAKERN_POLICY", "priorty"), BadValue, ["PORTAKERN_POLICY='priorty'"]),
]

TABLES = {"attention": ATTENTION, "quant_gemv": QUANT_GEMV, "quantize": QUANTIZE, "explain": EXPLAIN,
          "QuantizedWeight": QUANTIZED_WEIGHT, "use_backend/use_policy": OVERRIDES}


if __name__ == "__main__":  # print every case's outcome
    import sys

    for api, cases in TABLES.items():
        if len(sys.argv) > 1 and sys.argv[1] != api:
            continue
        print(f"== {api}: {len(cases)} cases")
        for cid, call, exc, frags in cases:
            try:
                call()
                got = "NO ERROR"
            except BaseException as e:
                got = f"{type(e).__name__}: {e}"
                bad = [f for f in frags if f not in str(e)]
                flag = "OK " if type(e) is exc and not bad else "XX "
                got = (flag + got + (f"  [missing {bad}]" if bad else "")
                       + ("" if type(e) is exc else f"  [want {exc.__name__}]"))
            print(f"  {cid}: {got[:400]}")
