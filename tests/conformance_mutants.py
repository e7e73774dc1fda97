"""Deliberately broken backends (test-only, never shipped): the conformance suite must catch each.

Every mutant is the CPU reference with one classic kernel bug planted:

* ``mutant-topleft-causal``   causal / window / ALiBi aligned top-left (``j <= i``) instead of
                              bottom-right (``j <= i + Sk - Sq``)
* ``mutant-unwritten``        leaves the last element of ``out`` unwritten
* ``mutant-nan-masked``       writes NaN (not zeros) in rows whose every key is masked
* ``mutant-group-off-by-one`` dequantizes column k with the scale and zero of group ``g + 1``
* ``mutant-awq-nibbles``      reads AWQ words in plain nibble order, ignoring AutoAWQ's interleave

``MutantPlugin`` registers them through the public plugin API (``portakern.plugins.register``).
"""

from __future__ import annotations

import numpy as np

from portakern.backends.cpu.backend import CpuBackend
from portakern.backends.cpu.quant_gemv import x_input
from portakern.ir import expr as E
from portakern.ir.expr import Expr
from portakern.ir.quant import Packing
from portakern.plugins import hookimpl

_DIAG = E.q_idx + E.seqlen_k - E.seqlen_q


class _Mutant(CpuBackend):
    priority = -100     # never chosen by dispatch unless named


def _top_left(e: Expr) -> Expr:
    """Replace the bottom-right diagonal ``q_idx + Sk - Sq`` by ``q_idx`` everywhere in ``e``."""
    if e == _DIAG:
        return E.q_idx
    if not e.args:
        return e
    return Expr(e.op, tuple(_top_left(a) for a in e.args), e.value)


class TopLeftCausal(_Mutant):
    name = "mutant-topleft-causal"

    def compile(self, op, device):
        if op.kind == "attention":
            op = op.replace(mask_mod=None if op.mask_mod is None else _top_left(op.mask_mod),
                            score_mod=None if op.score_mod is None else _top_left(op.score_mod))
        return super().compile(op, device)


class Unwritten(_Mutant):
    name = "mutant-unwritten"

    def compile(self, op, device):
        inner = super().compile(op, device)

        def kernel(*args):
            if op.kind == "attention":
                q, k, v, out, lse, aux = args
                tmp = np.zeros_like(out)
                inner(q, k, v, tmp, lse, aux)
            else:
                x, weight, out = args
                tmp = np.zeros_like(out)
                inner(x, weight, tmp)
            out.reshape(-1)[:-1] = tmp.reshape(-1)[:-1]   # the last element is never stored

        return kernel


class NanMaskedRows(_Mutant):
    name = "mutant-nan-masked"

    def compile(self, op, device):
        if op.kind != "attention":
            return super().compile(op, device)
        full = op.replace(return_lse=True)
        inner = super().compile(full, device)

        def kernel(q, k, v, out, lse, aux):
            l = np.empty(full.shapes()["lse"], dtype=np.float32)
            inner(q, k, v, out, l, aux)
            if lse is not None:
                lse[...] = l
            masked = np.isneginf(l)                     # (B, Hq, Sq) or (Hq, total_q) for varlen
            rows = masked.T if masked.ndim == 2 else masked.transpose(0, 2, 1)
            out[rows] = np.nan                          # 0/0 instead of the defined zeros

        return kernel


def _dequant_with_groups(op, weight, shift: int) -> np.ndarray:
    from portakern.ir.packing import unpack

    codes, scales, zeros, group = unpack(op.fmt, weight.tensors, op.N, op.K)
    g = np.minimum(group + shift, scales.shape[1] - 1)
    return (codes - zeros[:, g]) * scales[:, g]


class GroupOffByOne(_Mutant):
    name = "mutant-group-off-by-one"

    def compile(self, op, device):
        if op.kind != "quant_gemv":
            return super().compile(op, device)

        def kernel(x, weight, out):
            w = _dequant_with_groups(op, weight, shift=1)
            out[...] = x_input(op, np.asarray(x, np.float64)) @ w.T   # the prologue as the reference has it

        return kernel


def _plain_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 (R, C) -> (R, 8C) reading nibble i as column 8c + i (the bug: no AWQ interleave)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    return np.stack([(w >> np.uint32(4 * i)) & 0xF for i in range(8)], axis=-1).reshape(w.shape[0], -1)


class AwqNibbleSwap(_Mutant):
    name = "mutant-awq-nibbles"

    def compile(self, op, device):
        if op.kind != "quant_gemv" or op.fmt.packing is not Packing.AWQ:
            return super().compile(op, device)

        def kernel(x, weight, out):
            t = weight.tensors
            codes = _plain_nibbles(t["qweight"]).T.astype(np.float64)        # (N, K)
            zeros = _plain_nibbles(t["qzeros"]).T.astype(np.float64)         # (N, groups)
            scales = np.asarray(t["scales"], np.float64).T                    # (N, groups)
            g = np.arange(op.K) // op.fmt.group_size
            w = (codes - zeros[:, g]) * scales[:, g]
            out[...] = x_input(op, np.asarray(x, np.float64)) @ w.T

        return kernel


MUTANTS = (TopLeftCausal, Unwritten, NanMaskedRows, GroupOffByOne, AwqNibbleSwap)


class MutantPlugin:
    """A plugin object providing every mutant backend (register with ``portakern.plugins.register``)."""

    @hookimpl
    def portakern_register_backends(self):
        return [m() for m in MUTANTS]
