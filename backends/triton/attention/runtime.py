"""One compiled attention kernel for every sequence length of a shape class (``TritonBackend.runtime_lengths``).

Dispatch plans once per shape class (``portakern.lengths``) and hands the backend's one kernel calls whose
lengths differ: Sq and Sk (dense), total_q and total_k (varlen), the block table's width (paged). ``LengthKernel``
reads them from each call's arrays. A length seen before costs one dictionary lookup; a new one costs
``attention_at`` (the op at those lengths) and the table's configuration for it (``plan.choose``: the tile, the
split-KV count, which kernel), both host arithmetic, memoised in a bounded LRU keyed by the lengths.

The configuration, not the length, picks the built kernel (``forward.build_at``, kept in a second LRU keyed by
configuration): ``attn_fwd`` takes every length, stride and row count as a runtime integer, and its grid and
split-KV workspace follow the call. Triton then compiles once per configuration and per integer specialisation
(``== 1``, divisible by 16), never per length; ``KernelLaunch``'s fast path guards those integers by that same
specialisation. A decode loop whose Sk grows meets a few configurations (the split count grows with the keys up to
``tuning.MAX_SPLITS``), each compiled once. The Gluon kernels of sm_90 whose grid or descriptors span the lengths
(``forward.fixed_lengths``) get a built kernel per length instead (the compiled code is still Triton's one).

Nothing here re-enters dispatch or replans.
"""

from __future__ import annotations

from typing import Callable

from portakern import capture
from portakern.decision import brief
from portakern.devices import Device
from portakern.ir.ops import Attention
from portakern.lengths import attention_at
from portakern.lru import LRU

from . import forward, plan

#: lengths (a call's q, k and block table shapes) whose op and configuration are remembered
BOUND_LENGTHS = 256
#: configurations (or, for ``forward.fixed_lengths`` kernels, configurations at one length) holding a built kernel
BUILT_KERNELS = 32


class LengthKernel:
    """``kernel(q, k, v, out, lse, aux)`` for every member of ``op``'s shape class on ``device``.

    ``choose(at) -> AttnConfig`` gives the configuration of the op at a call's lengths (the table's, or the tuned
    one); ``config`` and ``workspace_bytes`` are those at ``op``'s own lengths, built when this is made (so a
    build error surfaces at compile time). ``builds`` counts built kernels (``forward.build_at``),
    ``configs`` the distinct configurations met."""

    def __init__(self, op: Attention, device: Device, choose: Callable[[Attention], object]):
        self.op, self.device, self._choose = op, device, choose
        self._bound = LRU(BOUND_LENGTHS)       # lengths -> (at, shapes, built kernel, configuration)
        self._built = LRU(BUILT_KERNELS)       # configuration (and lengths, where fixed) -> built kernel
        self.builds = 0
        self.configs: set = set()
        first = self._bind(op)
        self.config = first[3]
        self.workspace_bytes = plan.workspace_bytes(op, self.config)
        self._bound.put(self._key_of(op), first)
        self.__name__ = f"triton_attention_{op.content_hash()}"

    def __call__(self, q, k, v, out, lse, aux=None) -> None:
        bt = aux.get("block_table") if aux else None
        key = (tuple(q.shape), tuple(k.shape), None if bt is None else tuple(bt.shape))
        hit = self._bound.get(key)
        if hit is None:
            hit = self._bind(attention_at(self.op, key[0], key[1], key[2]))
            self._bound.put(key, hit)
        hit[2](hit[0], hit[1], q, k, v, out, lse, aux)

    def _key_of(self, op: Attention) -> tuple:
        s = op.shapes()
        return tuple(s["q"]), tuple(s["k"]), tuple(s["block_table"]) if "block_table" in s else None

    def _bind(self, at: Attention) -> tuple:
        """``(at, at.shapes(), built kernel, configuration)`` for the op at one call's lengths."""
        cfg = self._choose(at)
        self.configs.add(cfg)
        key = (cfg, at.seqlen_q, at.seqlen_k) if forward.fixed_lengths(at, cfg) else (cfg,)
        built = self._built.get(key)
        if built is None:
            if self._bound and capture.is_capturing():    # the first build is the plan's compile, before any call
                raise capture.CaptureError(
                    f"attention ({brief(at)}) on {self.device.label}: triton meets a new kernel configuration at "
                    f"seqlen_q={at.seqlen_q}, seqlen_k={at.seqlen_k} ({cfg}) inside CUDA stream capture, where "
                    f"compiling it cannot run; run one call at these lengths before capture")
            built = forward.build_at(at, self.device, cfg)
            self._built.put(key, built)
            self.builds += 1
        return at, at.shapes(), built, cfg


__all__ = ["BOUND_LENGTHS", "BUILT_KERNELS", "LengthKernel"]
