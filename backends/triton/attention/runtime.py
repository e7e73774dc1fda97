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
from portakern.ir.ops import Attention, KVLayout
from portakern.lengths import attention_at
from portakern.lru import LRU

from .. import tuning
from . import forward
from .config import Lengths

#: lengths (a call's q, k and block table shapes) whose lengths, shapes and kernel are remembered
BOUND_LENGTHS = 256
#: configurations chosen, by ``choice_key`` (lengths that pick one configuration share an entry)
CHOICES = 256
#: configurations (or, for ``forward.fixed_lengths`` kernels, configurations at one length) holding a built kernel
BUILT_KERNELS = 32


def lengths_of(op: Attention, q_shape: tuple, k_shape: tuple, bt_shape: tuple | None) -> tuple[Lengths, dict]:
    """``(Lengths, shapes)`` of the member of ``op``'s shape class whose q, k and block table have these shapes:
    what ``attention_at(op, ...)`` and its ``shapes()`` give for q, k, v, out and lse, without building the op."""
    Hq, Hkv, D, Dv = op.heads_q, op.heads_kv, op.head_dim, op.head_dim_v
    if op.kv_layout is KVLayout.VARLEN:
        tq, tk = max(q_shape[0], 1), k_shape[0]
        n = Lengths(tq, tk, tq)
        s = {"q": (tq, Hq, D), "k": (tk, Hkv, D), "v": (tk, Hkv, Dv), "out": (tq, Hq, Dv), "lse": (Hq, tq)}
    else:
        B, sq = op.batch, max(q_shape[1], 1)
        if op.kv_layout is KVLayout.PAGED:
            sk, kv = bt_shape[1] * op.page_size, (k_shape[0], op.page_size)
        else:
            sk = k_shape[1]
            kv = (B, sk)
        n = Lengths(sq, sk, B * sq)
        s = {"q": (B, sq, Hq, D), "k": (*kv, Hkv, D), "v": (*kv, Hkv, Dv), "out": (B, sq, Hq, Dv),
             "lse": (B, Hq, sq)}
    if not op.return_lse:
        del s["lse"]
    return n, s


def choice_key(n: Lengths) -> tuple:
    """What the table's choice (``plan.choose``) reads of the lengths: Sq and total_q exactly, Sk through the
    number of 16-key tiles (every key tile is a multiple of 16 keys: the split count and paged tiles follow
    ``ceil(Sk / block_n)``) and its comparisons (the Gluon prefill kernel's threshold, causal ``Sk >= Sq``, TMA's
    ``Sk > 1``). Lengths with one key share one configuration."""
    sq, sk = n.seqlen_q, n.seqlen_k
    return sq, n.total_q, -(-sk // 16), sk < tuning.WGMMA_D64_MIN_SEQLEN_K, sk < sq, sk > 1


class LengthKernel:
    """``kernel(q, k, v, out, lse, aux)`` for every member of ``op``'s shape class on ``device``.

    ``choose(at) -> AttnConfig`` gives the configuration of the op at a call's lengths (the table's, or the tuned
    one); ``config`` and ``workspace_bytes`` are those at ``op``'s own lengths, built when this is made (so a
    build error surfaces at compile time). ``builds`` counts built kernels (``forward.build_at``),
    ``configs`` the distinct configurations met."""

    def __init__(self, op: Attention, device: Device, choose: Callable[[Attention], object]):
        from . import plan

        self.op, self.device, self._choose = op, device, choose
        self._bound = LRU(BOUND_LENGTHS)       # q, k, block table shapes -> (Lengths, shapes, built kernel)
        self._choices = LRU(CHOICES)           # choice_key -> configuration (shared by its lengths)
        self._built = LRU(BUILT_KERNELS)       # configuration (and lengths, where fixed) -> built kernel
        self.builds = 0
        self.configs: set = set()
        s = op.shapes()
        self._bind(s["q"], s["k"], s.get("block_table"))
        self.config = self._last_config
        self.workspace_bytes = plan.workspace_bytes(op, self.config)
        self.__name__ = f"triton_attention_{op.content_hash()}"

    def built(self) -> list:
        """The built kernels held now (``forward.build_at``'s; introspection for tests and benchmarks)."""
        return list(self._built.values())

    def __call__(self, q, k, v, out, lse, aux=None) -> None:
        bt = aux.get("block_table") if aux else None
        key = (q.shape, k.shape, None if bt is None else bt.shape)
        hit = self._bound.get(key)
        if hit is None:
            hit = self._bind(*key)
        hit[2](hit[0], hit[1], q, k, v, out, lse, aux)

    def _bind(self, q_shape, k_shape, bt_shape) -> tuple:
        """``(Lengths, shapes, built kernel)`` for one call's shapes, remembered under them."""
        n, shapes = lengths_of(self.op, q_shape, k_shape, bt_shape)
        ckey = choice_key(n)
        choice = self._choices.get(ckey)      # (configuration, its built kernel when it serves every length)
        if choice is None:
            at = attention_at(self.op, q_shape, k_shape, bt_shape)
            cfg = self._choose(at)
            self.configs.add(cfg)
            fixed = forward.fixed_lengths(at, cfg)
            bkey = (cfg, n) if fixed else (cfg,)
            built = self._built.get(bkey)
            if built is None:
                built = self._build(at, cfg)
                self._built.put(bkey, built)
            if cfg.block_n % 16 == 0 and not fixed:   # the table's tiles always; any other is chosen per length
                self._choices.put(ckey, (cfg, built))
        else:
            cfg, built = choice
        self._last_config = cfg
        hit = (n, shapes, built)
        self._bound.put((tuple(q_shape), tuple(k_shape), None if bt_shape is None else tuple(bt_shape)), hit)
        return hit

    def _build(self, at: Attention, cfg):
        """``forward.build_at`` for ``at`` under ``cfg``; refused inside CUDA stream capture (but for the plan's
        own compile, made before any call)."""
        if self._bound and capture.is_capturing():
            raise capture.CaptureError(
                f"attention ({brief(at)}) on {self.device.label}: triton meets a new kernel configuration at "
                f"seqlen_q={at.seqlen_q}, seqlen_k={at.seqlen_k} ({cfg}) inside CUDA stream capture, where "
                f"compiling it cannot run; run one call at these lengths before capture")
        self.builds += 1
        return forward.build_at(at, self.device, cfg)


__all__ = ["BOUND_LENGTHS", "BUILT_KERNELS", "CHOICES", "LengthKernel", "Lengths", "choice_key", "lengths_of"]
