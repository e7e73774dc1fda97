"""Host side of the opencl attention kernel: what it supports, building ``kernels/attention.cl`` for an op,
launching it on pyopencl arrays.

Tile sizes (their caps in ``tuning``): ``BN`` keys per K/V tile, the largest power of two up to 64 whose two
tiles (``BN * (D + Dv)`` float32) fit the 32 KiB of local memory every OpenCL 1.2 (full profile) device has;
``BM`` query rows per work-group, ``G * Sq`` rounded up to a power of two, at most 64 or the device's
``max_work_group_size`` (decode with GQA fills a work-group with the G query heads of one kv head).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from portakern.arrays import to_numpy
from portakern.backend import YES, Support, no
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.ir.dtypes import DType
from portakern.ir.ops import Attention, KVLayout
from portakern.lengths import attention_at
from portakern.lru import LRU

from . import expr_opencl, tuning
from .common.program import build, defines, digest, kernel_source, work_group_cap

#: Local memory every OpenCL 1.2 full-profile device guarantees (CL_DEVICE_LOCAL_MEM_SIZE >= 32 KiB).
LOCAL_BYTES = 32 * 1024
#: Largest head dim: each work-item keeps its query row (D) and output accumulator (Dv) in private memory.
MAX_HEAD_DIM = 512
_LAYOUT = {KVLayout.DENSE: 0, KVLayout.PAGED: 1, KVLayout.VARLEN: 2}
_STORAGE = {DType.float16: "float16", DType.float32: "float32", DType.bfloat16: "float32"}
#: sequence lengths (a call's q, k and block table shapes) whose op, shapes and program a compiled kernel remembers
BOUND_LENGTHS = 256


def tiles(op: Attention, max_rows: int = tuning.ATTENTION_BM_MAX) -> tuple[int, int]:
    """``(BM, BN)`` for ``op`` (see the module docstring); ``max_rows``: the device's work-group cap."""
    bn = tuning.ATTENTION_BN_MAX
    while bn > 1 and bn * (op.head_dim + op.head_dim_v) * 4 > LOCAL_BYTES:
        bn //= 2
    rows = op.group_size * op.seqlen_q
    bm = 1
    while bm < min(rows, max_rows):
        bm *= 2
    return bm, bn


def supports(op: Attention, device) -> Support:
    for name, dim in (("head_dim", op.head_dim), ("head_dim_v", op.head_dim_v)):
        if dim > MAX_HEAD_DIM:
            return no(f"{name}={dim} is above the opencl backend's limit of {MAX_HEAD_DIM} (each work-item "
                      f"holds its query row and output accumulator in private memory); use backend='cpu'")
    dtype = DType.parse(op.dtype)
    if dtype not in _STORAGE:
        return no(f"dtype={dtype.value}: the opencl backend stores float16 or float32 (bfloat16 from torch travels "
                  "as float32); convert the inputs to float16 or float32")
    try:
        expr_opencl.source(op.score_mod, op.mask_mod)
    except UnsupportedError as e:
        return no(f"{e}; use backend='cpu'")
    return YES


def program_source(op: Attention, max_rows: int = tuning.ATTENTION_BM_MAX) -> str:
    """The full OpenCL C text for ``op``: defines, the lowered mods, then ``kernels/attention.cl``. No length is
    in it but through ``BM`` (the query rows of a work-group: ``G * Sq`` up to a power of two, capped), so the ops
    of one shape class share a handful of programs (``compile``)."""
    bm, bn = tiles(op, max_rows)
    half = DType.parse(op.dtype) is DType.float16
    vals = dict(D=op.head_dim, DV=op.head_dim_v, BM=bm, BN=bn, G=op.group_size, HQ=op.heads_q,
                LAYOUT=_LAYOUT[op.kv_layout], HAS_SEQLENS=int(op.has_seqlens_k), RETURN_LSE=int(op.return_lse),
                PAGE_SIZE=max(op.page_size, 1), IN_HALF=int(half), OUT_HALF=int(half))
    return (f"/* portakern opencl attention, BM={bm} */\n" + defines(vals)
            + expr_opencl.source(op.score_mod, op.mask_mod) + "\n" + kernel_source("attention.cl"))


def compile(op: Attention, device) -> Callable[..., None]:
    """``kernel(q, k, v, out, lse, aux)`` on pyopencl arrays for every sequence length of ``op``'s shape class
    (``OpenclBackend.runtime_lengths``): the lengths go to the kernel as arguments; a call's lengths pick the op at
    them (``attention_at``) and its program by ``BM`` (``program_source``), memoised by the lengths in a bounded
    LRU. Programs build per OpenCL context on first use."""
    op.verify()
    cap = work_group_cap(device, tuning.ATTENTION_BM_MAX)
    want = np.dtype(_STORAGE[DType.parse(op.dtype)])
    layout = op.kv_layout
    programs: dict[int, tuple[str, str]] = {}     # BM -> (source, digest): a few powers of two
    bound = LRU(BOUND_LENGTHS)                    # a call's q, k, block table shapes -> (op at them, its shapes, BM)

    def at_lengths(q, k, bt) -> tuple:
        lengths = (tuple(q.shape), tuple(k.shape), None if bt is None else tuple(bt.shape))
        hit = bound.get(lengths)
        if hit is None:
            at = attention_at(op, *lengths)
            bm = tiles(at, cap)[0]
            if bm not in programs:
                source = program_source(at, cap)
                programs[bm] = (source, digest(source))
            hit = (at, at.shapes(), bm)
            bound.put(lengths, hit)
        return hit

    def kernel(q, k, v, out, lse, aux=None) -> None:
        aux = dict(aux or {})
        at, shapes, bm = at_lengths(q, k, aux.get("block_table"))
        source, key = programs[bm]
        for name, a in (("q", q), ("k", k), ("v", v), ("out", out)) + ((("lse", lse),) if op.return_lse else ()):
            if tuple(a.shape) != shapes[name]:
                raise InvalidInputError(f"{name} has shape {tuple(a.shape)}, expected {shapes[name]} for this "
                                        f"{layout.value} attention op")
        for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
            if a.dtype != want:
                raise InvalidInputError(f"{name} has dtype {a.dtype}: the opencl attention kernel for "
                                        f"{DType.parse(op.dtype).value} reads and writes {want}")
        queue = out.queue
        knl = build(queue.context, source, "attention", "pk_attention", key)
        idx0, idx1 = _index_arrays(op, aux, queue)
        if layout is KVLayout.VARLEN:   # rows past cu_seqlens_q[-1] belong to no sequence: 0 and -inf
            (out.view(np.uint16) if out.dtype == np.float16 else out).fill(0)  # half: no fp16 fill kernel
            if lse is not None:
                lse.fill(np.float32(-np.inf))
        lse_buf = lse.base_data if lse is not None else out.base_data
        if lse is not None and lse.offset:
            raise InvalidInputError("lse must start at its buffer's beginning (offset 0)")
        if out.offset or not out.flags.c_contiguous:
            raise InvalidInputError("out must be a contiguous array at offset 0 of its buffer")
        rows_q = at.seqlen_q if layout is not KVLayout.VARLEN else at.total_q
        nblocks = -(-at.group_size * rows_q // bm)
        args = [q.base_data, k.base_data, v.base_data, out.base_data, lse_buf, idx0, idx1,
                np.float32(at.scale), np.int32(at.seqlen_q), np.int32(at.seqlen_k), np.int32(shapes["out"][0])]
        for a in (q, k, v):
            args += _strides(a, layout)
        knl(queue, (nblocks * bm, at.heads_kv, at.batch), (bm, 1, 1), *args)

    kernel.__name__ = f"opencl_attention_{op.content_hash()}"
    return kernel


def _strides(a: Any, layout: KVLayout) -> list:
    """``[offset, batch-or-page stride, row stride, head stride]`` in elements (varlen: no batch stride)."""
    it = a.dtype.itemsize
    st = [s // it for s in a.strides]
    if layout is KVLayout.VARLEN:   # (rows, H, D)
        return [np.int64(a.offset // it), np.int64(0), np.int64(st[0]), np.int64(st[1])]
    return [np.int64(a.offset // it), np.int64(st[0]), np.int64(st[1]), np.int64(st[2])]


def _index_arrays(op: Attention, aux: dict, queue) -> tuple[Any, Any]:
    """``(idx0, idx1)`` int32 device buffers for the kernel (a one-element dummy where unused)."""
    import pyopencl.array as cla

    def dev(name):
        a = aux.get(name)
        if a is None:
            raise InvalidInputError(f"aux[{name!r}] is missing: this attention op needs it")
        if not isinstance(a, cla.Array) or not a.flags.c_contiguous:   # a strided view: its values, packed
            a = cla.to_device(queue, np.ascontiguousarray(to_numpy(a)))
        if a.dtype != np.int32:
            a = a.astype(np.int32)
        if a.offset:
            a = a.copy()
        return a.base_data

    if op.kv_layout is KVLayout.VARLEN:
        return dev("cu_seqlens_q"), dev("cu_seqlens_k")
    if op.kv_layout is KVLayout.PAGED:
        return dev("block_table"), dev("seqlens_k")
    arr = _dummies.get(queue.context.int_ptr)
    if arr is None:
        arr = _dummies.setdefault(queue.context.int_ptr, cla.zeros(queue, 1, np.int32))
    dummy = arr.base_data
    return (dummy, dev("seqlens_k")) if op.has_seqlens_k else (dummy, dummy)


#: a one-element int32 buffer per OpenCL context, passed for index arrays a layout does not read
_dummies: dict[int, Any] = {}
