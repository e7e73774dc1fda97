"""One decode step of a Llama-3-8B-shaped model (batch 1), captured in one CUDA graph.

32 layers, hidden 4096, MLP 14336, 32 query / 8 KV heads of 128, vocab 128256, random weights.
portakern's step: every linear (qkv, o, gate+up, down, lm_head) is int4 group-128 asymmetric through
the kernel ``torch.ops.portakern.quant_gemv`` picks for its shape (``torch_ops.gemv_kernel``: the triton table, or
the cuda backend where its measured table ranks it first; weights straight in the triton layout, which both read;
the results name each linear's backend), attention is
``portakern.attention`` over a paged KV cache (page 64, shuffled block table; torch SDPA on a dense
cache when the triton backend cannot serve it, said in the output), the element-wise glue
(residual add + RMSNorm, RoPE with the KV-cache append, SiLU-mul) is torch, fused by
``torch.compile`` with Inductor's combo kernels, each launched as a programmatic dependent of the kernel
before it (``--glue compile-pdl``, the default where Inductor can: it then starts while that kernel
drains, and the GEMV after it starts loading weights while it runs; ``--glue compile-combo``: not
dependent launches; ``--glue compile``: no combo kernels either, RoPE of q and of k + the append are two
launches; ``--glue eager``: plain torch ops). Peers re-measured in the same run, plain
PyTorch as in ``shared/peers``: bf16 ``F.linear`` and tinygemm int4 (``_weight_int4pack_mm``), SDPA
on a dense cache, eager glue.

Floor = (weight bytes: codes + fp16 scale + fp16 zero per group; + K/V bytes read) / copy bandwidth.

    python benchmarks/decode_step.py [--ctx 2048 8192] [--glue compile-combo|compile-pdl|compile|compile-max|eager]
        [--compare-glue GLUE] [--compare-attention table release early early+o2 ...] [--cluster-gemv o,down ...]
        [--wide-gemv o,down ... --wide-from JSON] [--compare-gemv-backend triton]
        [--l2-prefetch UNITS ...] [--compare-tiles] [--prefetch none after:24 during:24]
        [--chain AHEAD,PER_SM,L2_AHEAD[,attn|,step] ...] [--sweep-gemv LINEAR ...] [--sweep-attention]
        [--ab-gemv LINEAR:CONFIG ...] [--ab-attention CONFIG ...]
        [--captures N] [--breakdown] [--no-peers] [--no-eager] [--out DIR]

The same-process variants (``--compare-*``, ``--sweep-*``, ``--ab-*``, ``--chain``, ``--cluster-gemv``,
``--wide-gemv``, ``--compare-gemv-backend``, ``--l2-prefetch``) are defined in ``benchmarks/step_variants.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from dataclasses import replace
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gemv import copy_bandwidth_TBps, random_prepared  # noqa: E402

from step_timing import capture, kernel_profile, kernel_timeline, logits_diff, time_step  # noqa: E402
from step_variants import ATTENTION_VARIANTS, add_variant_arguments, gemv_op, variants_for  # noqa: E402

from portakern.backends.triton import gemv_tuning as T  # noqa: E402
from portakern.backends.triton import quant_gemv as Q  # noqa: E402
from portakern.conformance.report import run_identity  # noqa: E402
from portakern.devices import torch_device  # noqa: E402

from step_glue import (BF16, D, DEFAULT_GLUE, GLUES, HID, HKV, HQ, LAYERS, MLP, PAGE, VOCAB,  # noqa: E402,F401
                       add_rmsnorm, glue_functions, rope, rope_append, silu_mul)


def gemv_kernel(N: int, K: int, group_rows: bool = True, l2_prefetch: int = 0, prefetch: int = 1):
    """portakern's int4 g128 quant_gemv kernel for one linear at M = 1: the table's configuration
    (``group_rows=False``: the table without group-resident tiles or the stream kernel), its stream
    kernel asking the L2 for ``l2_prefetch`` units ahead (``GemvConfig.l2_prefetch``), the table's kernel
    keeping ``prefetch`` tiles of words in flight (``GemvConfig.prefetch``; refused where the kernel has 1)."""
    dev = torch_device("cuda", 0)
    op = gemv_op(N, K)
    if group_rows and not l2_prefetch and prefetch == 1:   # the table
        return Q.compile(op, dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = T.choose(Q._LayoutStub(op), 1, N, T.arch_family(dev.capability), sms, group_rows=group_rows,
                   stream=group_rows)
    if l2_prefetch and cfg.kind == "stream":
        cfg = replace(cfg, l2_prefetch=l2_prefetch)
    return Q.compile(op, dev, replace(cfg, prefetch=prefetch))


def chosen_gemvs(linears: dict, backend: str | None = None) -> tuple[dict, dict]:
    """``({name: backend name}, {name: kernel})``: what ``torch.ops.portakern.quant_gemv`` runs for each ``(N, K)``
    linear at M = 1 (``torch_ops.gemv_kernel``: the triton table, or the cuda backend where its measured table ranks
    it first); ``backend`` forces one (``dispatch.use_backend``)."""
    from portakern import dispatch, torch_ops

    names, kernels = {}, {}
    with dispatch.use_backend(backend) if backend else contextlib.nullcontext():
        for n, (N, K) in linears.items():
            names[n], kernels[n] = torch_ops.gemv_kernel(gemv_op(N, K), torch_device("cuda", 0))
    return names, kernels


# -- portakern's step --------------------------------------------------------------------------------

class PortakernStep:
    def __init__(self, ctx: int, glue: str, attention: str, group_rows: bool = True,
                 prefetch: str = "none", prefetch_mb: float = 24.0):
        shapes = {"qkv": ((HQ + 2 * HKV) * D, HID), "o": (HID, HQ * D), "gu": (2 * MLP, HID), "down": (HID, MLP)}
        self.linears = {**shapes, "lm": (VOCAB, HID)}
        # the GEMVs: the kernels portakern's op picks per linear (group_rows=False: the triton table without
        # group-resident tiles, an experiment); which backend each runs on is recorded with the results
        if group_rows:
            self.gemv_backends, self.kern = chosen_gemvs(self.linears)
        else:
            self.gemv_backends = {n: "triton" for n in self.linears}
            self.kern = {n: gemv_kernel(N, K, group_rows) for n, (N, K) in self.linears.items()}
        self.layers = [{n: random_prepared(N, K, 4, 128, False) for n, (N, K) in shapes.items()}
                       for _ in range(LAYERS)]
        self.lm = random_prepared(VOCAB, HID, 4, 128, False)
        self.norms = [torch.rand(HID, device="cuda").to(BF16) + 0.5 for _ in range(2 * LAYERS + 1)]
        self.out = {n: torch.empty(1, N, device="cuda", dtype=BF16) for n, (N, K) in {**shapes, "lm": (VOCAB, HID)}.items()}
        # -- paged KV: pages of PAGE tokens, a shuffled block table; k and v of a layer share one tensor
        self.ctx = ctx
        pages = math.ceil((ctx + 1) / PAGE)
        self.kv = [torch.randn(2, pages, PAGE, HKV, D, device="cuda", dtype=BF16) for _ in range(LAYERS)]
        self.block_table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
        self.seqlens = torch.tensor([ctx + 1], device="cuda", dtype=torch.int32)
        pos = ctx  # the new token's position; its slot in the flattened page pool
        page = int(self.block_table[0, pos // PAGE])
        self.slot = torch.tensor([page * PAGE + pos % PAGE], device="cuda")
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        self.cos, self.sin = torch.cos(pos * inv), torch.sin(pos * inv)
        self.h = torch.randn(1, HID, device="cuda")
        self.zero = torch.zeros(1, HID, device="cuda")
        self.attention = attention
        self.fused_silu = False   # with_fused_silu: the down GEMV forms silu(gate) * up itself
        self.chain = None         # with_chain: each layer after its attention as one launch
        self.attn_kernel = self.attn_out = None   # portakern.attention's choice unless with_attention
        self.add_rmsnorm, self.rope, self.rope_append, self.silu_mul = glue_functions(glue)
        if attention == "sdpa":  # dense (B, Hkv, S, D) caches instead of pages
            self.dense = [torch.randn(2, 1, HKV, ctx + 1, D, device="cuda", dtype=BF16) for _ in range(LAYERS)]
        # -- L2 prefetch of the next GEMV's weight from a side stream ("after": once the current GEMV
        #    is done, over the glue / attention between the two; "during": alongside the current GEMV)
        self.prefetch, self.prefetch_bytes = prefetch, int(prefetch_mb * 2**20)
        self.side = torch.cuda.Stream() if prefetch != "none" else None
        self.order = [L[n] for L in self.layers for n in ("qkv", "o", "gu", "down")] + [self.lm]
        self.next_of = {id(w): nxt for w, nxt in zip(self.order, self.order[1:])}

    def prefetch_weight(self, w):
        """Fork the side stream here and prefetch ``w``'s leading bytes into L2 from it."""
        from experiments.l2_prefetch import prefetch_l2  # benchmarks/experiments

        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            prefetch_l2((w.qweight, w.scales, w.zeros), self.prefetch_bytes)

    def with_gemv_backend(self, backend: str) -> "PortakernStep":
        """The same step (weights, caches shared) with every GEMV on ``backend``'s kernel for its shape (the
        backend forced as ``dispatch.use_backend`` forces it; ``--compare-gemv-backend``)."""
        other = copy.copy(self)
        other.gemv_backends, other.kern = chosen_gemvs(self.linears, backend)
        return other

    def with_gemv(self, kernels: dict, backend: str) -> "PortakernStep":
        """The same step (weights, caches shared) with the linears named in ``kernels`` run by those kernels (of
        ``backend``, which the results record)."""
        other = copy.copy(self)
        other.kern = {**self.kern, **kernels}
        other.gemv_backends = {**self.gemv_backends, **{n: backend for n in kernels}}
        return other

    def with_l2_prefetch(self, units: int) -> "PortakernStep":
        """The same step with its stream-kernel GEMVs asking the L2 for ``units`` units ahead before they wait
        for the kernel before them."""
        return self.with_gemv({n: gemv_kernel(N, K, l2_prefetch=units) for n, (N, K) in self.linears.items()},
                              "triton")

    def with_attention(self, spec: str) -> "PortakernStep":
        """The same step with its paged attention built by the triton backend under the table's configuration
        changed as ``ATTENTION_VARIANTS[variant]`` says (``--compare-attention``); ``spec`` is ``variant`` or
        ``variant+LINEAR2``: also the GEMV of ``LINEAR`` keeping two tiles of words in flight."""
        from portakern.backends.triton import attention as A

        variant, _, deeper = spec.partition("+")
        op, device = self.attention_op()
        other = self.with_attention_config(replace(A._config(op, device), **ATTENTION_VARIANTS[variant]))
        if deeper:
            name, depth = deeper[:-1], int(deeper[-1])
            other = other.with_gemv({name: gemv_kernel(*self.linears[name], prefetch=depth)}, "triton")
        return other

    def attention_op(self):
        """The step's paged attention as a portakern op, and the device it runs on."""
        from portakern.validate import attention_op

        q = torch.zeros(1, 1, HQ, D, device="cuda", dtype=BF16)
        op, info = attention_op(q, self.kv[0][0], self.kv[0][1], block_table=self.block_table,
                                seqlens_k=self.seqlens)
        return op, info.device

    def with_attention_config(self, cfg) -> "PortakernStep":
        """The same step with its paged attention built by the triton backend under ``cfg`` (an ``AttnConfig``)."""
        from portakern.backends.triton import attention as A

        op, device = self.attention_op()
        other = copy.copy(self)
        other.attn_kernel = A.build(op, device, cfg)
        other.attn_out = torch.empty(1, 1, HQ, D, device="cuda", dtype=BF16)
        return other

    def attention_candidates(self) -> list:
        """The autotuner's configurations of the step's paged attention on this GPU (the table's first)."""
        from portakern.backends.triton import attention as A
        from portakern.backends.triton import tuning

        op, device = self.attention_op()
        return tuning.candidates(op, *A._device_arch(device))

    def with_gemv_config(self, name: str, cfg) -> "PortakernStep":
        """The same step with the linear ``name``'s GEMV compiled under ``cfg`` (``--sweep-gemv``)."""
        return self.with_gemv({name: Q.compile(gemv_op(*self.linears[name]), torch_device("cuda", 0), cfg)}, "triton")

    def with_fused_silu(self) -> "PortakernStep":
        """The same step without the SiLU-mul glue kernel: the down projection's GEMV reads the gate/up output
        through the ``silu_mul`` prologue (``QuantGemv.prologue``; the table's kernel for that op)."""
        op = gemv_op(*self.linears["down"]).replace(prologue="silu_mul")
        other = self.with_gemv({"down": Q.compile(op, torch_device("cuda", 0))}, "triton")
        other.fused_silu = True
        return other

    def with_chain(self, ahead: int = 1, per_sm: int = 2, l2_ahead: int = 0, mode: str = "gemv",
                   check: bool = True) -> "PortakernStep":
        """The same step (weights, caches shared) with each layer after its attention (``mode`` "gemv"), each whole
        layer ("attn") or every layer at once ("step": stacked copies of the weights and caches) run as one launch
        of ``experiments/layer_chain.py`` / ``step_chain.py``'s kernels; ``check``: layer 0 checked first against
        this step's own attention, glue and GEMVs, or the one-launch step bit for bit against the layer launches
        (``chain_check``)."""
        from experiments.gemv_chain import reset_counters
        from experiments.layer_chain import LayerChain, check_layer
        from experiments.step_chain import StepChain, check_step

        if mode not in ("gemv", "attn", "step"):
            raise ValueError(f"mode={mode!r}: one of 'gemv' (the layer after its attention), 'attn' (the whole layer) "
                             f"or 'step' (every layer in one launch)")
        other = copy.copy(self)
        if mode == "step":
            other.chain = StepChain(self, ahead, per_sm, l2_ahead)
            other.chain_check = check_step(self, other.chain, ahead, per_sm, l2_ahead) if check else None
        else:
            other.chain = LayerChain(self, ahead, per_sm, l2_ahead, attention=mode == "attn")
            other.chain_check = check_layer(self, other.chain) if check else None
        if check:
            print(f"chain {ahead},{per_sm},{l2_ahead},{mode}: {other.chain_check}", flush=True)
            reset_counters(other.chain)     # a spin error in the check must not leave the timed launches mixed
        other.out = {**self.out, "lm": other.chain.logits}
        return other

    def with_glue(self, glue: str, deterministic: bool = False) -> "PortakernStep":
        """The same step (weights, caches, buffers shared) with its glue run as ``glue``."""
        other = copy.copy(self)
        other.add_rmsnorm, other.rope, other.rope_append, other.silu_mul = glue_functions(glue, deterministic)
        return other

    def gemv(self, name, x, w):
        out = self.out[name]
        nxt = self.next_of.get(id(w)) if self.side is not None else None
        if nxt is not None and self.prefetch == "during":
            self.prefetch_weight(nxt)
        self.kern[name](x, w, out)
        if nxt is not None and self.prefetch == "after":
            self.prefetch_weight(nxt)
        return out

    def rope_attend(self, i, qkv):
        """RoPE, the new token's k and v appended to layer ``i``'s cache, attention over the cache."""
        if self.attention == "sdpa":
            q, kv_new = self.rope(qkv, self.cos, self.sin)
            c = self.dense[i]
            c[:, :, :, self.ctx] = kv_new
            o = F.scaled_dot_product_attention(q.transpose(1, 2), c[0], c[1], enable_gqa=True)
            return o.transpose(1, 2).reshape(1, HQ * D)
        q = self.rope_append(qkv, self.cos, self.sin, self.kv[i].view(2, -1, HKV, D), self.slot)
        return self.attend(i, q)

    def attend(self, i, q):
        import portakern

        if self.attn_kernel is not None:   # built with an explicit configuration (with_attention)
            self.attn_kernel(q, self.kv[i][0], self.kv[i][1], self.attn_out, None,
                             {"block_table": self.block_table, "seqlens_k": self.seqlens})
            return self.attn_out.reshape(1, HQ * D)
        o = portakern.attention(q, self.kv[i][0], self.kv[i][1], block_table=self.block_table,
                                seqlens_k=self.seqlens, backend="triton")
        return o.reshape(1, HQ * D)

    def __call__(self):
        if self.chain is not None:   # with_chain: the chain runs the step (experiments/layer_chain.py, step_chain.py)
            return self.chain()
        if self.side is not None:
            self.prefetch_weight(self.order[0])
        r, xn = self.add_rmsnorm(self.h, self.zero, self.norms[0])
        for i, L in enumerate(self.layers):
            a = self.rope_attend(i, self.gemv("qkv", xn, L["qkv"]))
            o = self.gemv("o", a, L["o"])
            r, xn = self.add_rmsnorm(r, o, self.norms[2 * i + 1])
            gu = self.gemv("gu", xn, L["gu"])
            act = gu if self.fused_silu else self.silu_mul(gu)
            d = self.gemv("down", act, L["down"])
            r, xn = self.add_rmsnorm(r, d, self.norms[2 * i + 2])
        out = self.gemv("lm", xn, self.lm)
        if self.side is not None:   # join the side stream (a captured graph must end joined)
            torch.cuda.current_stream().wait_stream(self.side)
        return out

    def part(self, name: str):
        """The step's ``name`` kernels alone, in the step's order and on its shapes (``--breakdown``):
        "gemv" (every quant_gemv incl. lm_head), "attention" (paged attention per layer), "glue"
        (RMSNorm, RoPE + KV append, SiLU-mul)."""
        xn = torch.randn(1, HID, device="cuda").to(BF16)
        act = torch.randn(1, MLP, device="cuda").to(BF16)
        qkv = torch.randn(1, (HQ + 2 * HKV) * D, device="cuda").to(BF16)
        q, _ = self.rope(qkv, self.cos, self.sin)
        gu = torch.randn(1, 2 * MLP, device="cuda").to(BF16)

        def gemvs():
            for L in self.layers:
                self.gemv("qkv", xn, L["qkv"])
                self.gemv("o", xn, L["o"])
                self.gemv("gu", xn, L["gu"])
                self.gemv("down", act, L["down"])
            self.gemv("lm", xn, self.lm)

        def attention():
            for i in range(LAYERS):
                self.attend(i, q)

        def glue():
            r = self.h
            for i in range(LAYERS):
                self.rope_append(qkv, self.cos, self.sin, self.kv[i].view(2, -1, HKV, D), self.slot)
                r, _ = self.add_rmsnorm(r, xn, self.norms[2 * i + 1])
                self.silu_mul(gu)
                r, _ = self.add_rmsnorm(r, xn, self.norms[2 * i + 2])

        return {"gemv": gemvs, "attention": attention, "glue": glue}[name]

    def bytes(self):
        per_group = 4  # fp16 scale + fp16 zero
        lin = [((HQ + 2 * HKV) * D, HID), (HID, HQ * D), (2 * MLP, HID), (HID, MLP)]
        w = LAYERS * sum(N * K // 2 + N * K // 128 * per_group for N, K in lin)
        w += VOCAB * HID // 2 + VOCAB * HID // 128 * per_group
        return w + LAYERS * 2 * (self.ctx + 1) * HKV * D * 2


# -- plain-PyTorch peers -----------------------------------------------------------------------------

class TorchStep:
    """bf16 F.linear or tinygemm int4 linears, SDPA on a dense cache, eager glue (as in shared/peers)."""

    def __init__(self, ctx: int, kind: str):
        self.kind, self.ctx = kind, ctx
        shapes = {"qkv": ((HQ + 2 * HKV) * D, HID), "o": (HID, HQ * D), "gu": (2 * MLP, HID), "down": (HID, MLP)}

        def make(N, K):
            if kind == "bf16":
                return torch.randn(N, K, device="cuda", dtype=BF16) * 0.02
            packed = torch.ops.aten._convert_weight_to_int4pack(
                torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda"), 8)
            return packed, (torch.rand(K // 128, N, 2, device="cuda") * 0.01).to(BF16)

        self.layers = [{n: make(N, K) for n, (N, K) in shapes.items()} for _ in range(LAYERS)]
        self.lm = make(VOCAB, HID)
        self.norms = [torch.rand(HID, device="cuda").to(BF16) + 0.5 for _ in range(2 * LAYERS + 1)]
        self.cache = [torch.randn(2, 1, HKV, ctx + 1, D, device="cuda", dtype=BF16) for _ in range(LAYERS)]
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        self.cos, self.sin = torch.cos(ctx * inv), torch.sin(ctx * inv)
        self.h = torch.randn(1, HID, device="cuda")
        self.zero = torch.zeros(1, HID, device="cuda")

    def lin(self, x, w):
        if self.kind == "bf16":
            return F.linear(x, w)
        return torch.ops.aten._weight_int4pack_mm(x, w[0], 128, w[1])

    def __call__(self):
        r, xn = add_rmsnorm(self.h, self.zero, self.norms[0])
        for i, L in enumerate(self.layers):
            q, kv_new = rope(self.lin(xn, L["qkv"]), self.cos, self.sin)
            c = self.cache[i]
            c[:, :, :, self.ctx] = kv_new
            a = F.scaled_dot_product_attention(q.transpose(1, 2), c[0], c[1], enable_gqa=True)
            r, xn = add_rmsnorm(r, self.lin(a.transpose(1, 2).reshape(1, HQ * D), L["o"]), self.norms[2 * i + 1])
            d = self.lin(silu_mul(self.lin(xn, L["gu"])), L["down"])
            r, xn = add_rmsnorm(r, d, self.norms[2 * i + 2])
        return self.lin(xn, self.lm)

    def bytes(self):
        lin = [((HQ + 2 * HKV) * D, HID), (HID, HQ * D), (2 * MLP, HID), (HID, MLP)]
        n = LAYERS * sum(N * K for N, K in lin) + VOCAB * HID
        w = 2 * n if self.kind == "bf16" else n // 2 + n // 128 * 4
        return w + LAYERS * 2 * (self.ctx + 1) * HKV * D * 2


# -- logits of two glues ----------------------------------------------------------------------------

def same_logits(step, glue: str, other: str) -> dict:
    """Logits of ``step`` captured with each glue compiled in Inductor's deterministic mode (no configuration
    chosen by timing), one replay each: with the same kernels in a different launch order or kind the two
    must be equal bit for bit. (The timed glues may differ in the last bits: Inductor times reduction
    configurations on first use, and a different reduction order changes the rounding.)"""
    if not hasattr(torch._inductor.config, "deterministic"):
        return {"skipped": f"torch {torch.__version__}: no torch._inductor.config.deterministic"}
    outs = []
    for g in (glue, other):
        st = step.with_glue(g, deterministic=True)
        capture(st)
        outs.append(st.out["lm"].float().clone())
    return {"glues": [glue, other], **logits_diff(*outs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192], metavar="TOKENS",
                    help="context lengths of the paged KV cache, each a separate step (default 2048 8192)")
    ap.add_argument("--glue", choices=GLUES, default=DEFAULT_GLUE,
                    help="portakern's glue: torch.compile with Inductor's combo kernels (the kernels of one glue "
                         "function that Inductor cannot fuse launched as one; H200 session 13: 10 instead of 11 "
                         "kernels per layer, 2.472 vs 2.495 ms at ctx 2048), the same with each glue kernel launched "
                         "as a programmatic dependent of the kernel before it (Inductor's triton.enable_pdl; the "
                         "default where this torch has it, else compile-combo), plain torch.compile, torch.compile "
                         "with Inductor's autotuning (mode max-autotune-no-cudagraphs), or plain torch ops; default "
                         f"here {DEFAULT_GLUE}")
    ap.add_argument("--compare-glue", choices=GLUES, metavar="GLUE",
                    help="also time portakern's step (the same weights, in the same process) with its glue run as "
                         "GLUE, and record the largest difference of the two steps' logits (same kernels: 0 expected)")
    add_variant_arguments(ap)
    ap.add_argument("--no-eager", action="store_true", help="time the steps in their CUDA graphs only")
    ap.add_argument("--captures", type=int, default=1, metavar="N",
                    help="capture each step's graph N times afresh and report the median of the captures' medians "
                         "(each capture's in graph_ms_per_capture): one process has shown two levels ~0.04 ms apart "
                         "for the same step captured at different times (session 17)")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the plain-PyTorch peers (bf16 F.linear and tinygemm int4 steps, SDPA, eager glue)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"),
                    help="folder of the result JSON decode-step-<date><tag>.json (default $OUT or benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix of the result file name, e.g. -s27-h200")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time portakern's step's GEMVs, attention and glue each alone in its own graph, "
                         "profile per-kernel device time, and attribute one replay's span to its kernels "
                         "(exposed time: what each moved the finish line by, overlaps under PDL counted once)")
    ap.add_argument("--compare-tiles", action="store_true",
                    help="also time portakern's step with the per-word-row GEMV tile everywhere (the table "
                         "without GemvConfig.group_rows and without the stream-K kernel), as int4_portakern_word_rows")
    ap.add_argument("--prefetch", nargs="+", default=["none"], metavar="MODE[:MB]",
                    help="portakern step variants with an L2 prefetch of the next GEMV's weight from a side "
                         "stream: none, after (once the current GEMV is done), during (alongside it); "
                         "':MB' caps the bytes per weight (default 24). Each variant after the first is "
                         "reported as int4_portakern_prefetch_<MODE>_<MB>")
    args = ap.parse_args()

    bw = copy_bandwidth_TBps()
    res = {"model": "Llama-3-8B shapes, random weights, batch 1", "date": datetime.date.today().isoformat(),
           "copy_TBps": bw, "glue": args.glue, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "results": {}}
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    for ctx in args.ctx:
        runs = {}
        att = "portakern-paged"
        try:
            step = PortakernStep(ctx, args.glue, "portakern")
            t0 = time.time()
            step()
            torch.cuda.synchronize()
            print(f"ctx {ctx}: first step (compiles) {time.time() - t0:.1f}s", flush=True)
        except Exception as e:
            print(f"ctx {ctx}: portakern paged attention unavailable ({type(e).__name__}: {str(e)[:200]}); "
                  "using torch SDPA on a dense cache", flush=True)
            att = "sdpa-dense"
            step = PortakernStep(ctx, args.glue, "sdpa")
        runs["int4_portakern"] = (step, att)
        pk_attention = att
        for spec in [p for p in args.prefetch if p != "none"]:
            mode, _, mb = spec.partition(":")
            mb = float(mb or 24)
            runs[f"int4_portakern_prefetch_{mode}_{mb:g}"] = (
                PortakernStep(ctx, args.glue, att.split("-")[0], prefetch=mode, prefetch_mb=mb), att)
        # the same step (weights, caches) changed one way: timed here, its logits compared
        variants = variants_for(step, args) if att == "portakern-paged" else {}
        runs.update({name: (st, att) for name, st in variants.items()})
        variants = set(variants)   # names only: each step is freed once timed
        if args.compare_tiles:
            runs["int4_portakern_word_rows"] = (PortakernStep(ctx, args.glue, att.split("-")[0],
                                                              group_rows=False), att)
        if not args.no_peers:
            runs["bf16"] = (TorchStep(ctx, "bf16"), "sdpa-dense")
            runs["int4_tinygemm"] = (TorchStep(ctx, "tinygemm"), "sdpa-dense")
        out = {}
        logits = None
        for name, (st, att) in runs.items():
            try:
                nbytes = st.bytes()
                floor_ms = nbytes / (bw * 1e12) * 1e3
                per_capture = [time_step(st, graph=True) for _ in range(args.captures)]
                graph = statistics.median(per_capture)
                out[name] = {"attention": att, "bytes_GB": nbytes / 1e9, "floor_ms": floor_ms, "graph_ms": graph,
                             "graph_frac_floor": floor_ms / graph}
                if hasattr(st, "gemv_backends"):
                    out[name]["gemv_backends"] = dict(st.gemv_backends)
                if args.captures > 1:
                    out[name]["graph_ms_per_capture"] = per_capture
                if not args.no_eager:
                    eager = time_step(st, graph=False, reps=5)
                    out[name].update(eager_ms=eager, eager_frac_floor=floor_ms / eager, graph_speedup=eager / graph)
                if name == "int4_portakern":
                    logits = st.out["lm"].float().clone()   # the last replay's; every replay computes the same
                elif name in variants and logits is not None:
                    out[name].update(logits_diff(logits, st.out["lm"].float()))
                    if getattr(st, "chain", None) is not None:
                        from experiments.gemv_chain import spin_error, wait_profile
                        out[name]["layer_check"] = st.chain_check
                        out[name]["spin_error"] = spin_error(st.chain)
                        try:      # after the timing: its own launches
                            out[name]["wait_profile"] = wait_profile(st.chain)
                        except Exception as e:
                            out[name]["wait_profile"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if name.startswith("int4_portakern_glue_"):
                        out[name]["deterministic_glues"] = same_logits(step, args.glue, args.compare_glue)
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"ctx {ctx} {name}: {json.dumps(out[name])}", flush=True)
            runs[name] = None
            del st
            torch.cuda.empty_cache()
        if args.breakdown and pk_attention == "portakern-paged":
            st = PortakernStep(ctx, args.glue, "portakern")
            parts = {}
            for part in ("gemv", "attention", "glue"):
                try:
                    parts[part + "_graph_ms"] = time_step(st.part(part), graph=True)
                except Exception as e:
                    parts[part + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            parts["kernels"] = kernel_profile(st)
            try:   # built after the last device run of session 18: first used on a GPU next session
                parts["timeline"] = kernel_timeline(st)
            except Exception as e:
                parts["timeline_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["int4_portakern"]["parts"] = parts
            print(f"ctx {ctx} parts: {json.dumps({k: v for k, v in parts.items() if k not in ('kernels', 'timeline')})}",
                  flush=True)
            for k in parts["kernels"][:20]:
                print(f"  {k['us_total']:9.1f} us  {k['calls']:5d} x {k['us_mean']:7.2f} us  {k['name'][:90]}")
            tl = parts.get("timeline")
            if tl:
                print(f"  one replay: span {tl['span_us']:.1f} us, idle {tl['idle_us']:.1f} us; exposed / duration:")
                for k in tl["kernels"][:20]:
                    print(f"  {k['us_exposed']:9.1f} / {k['us_duration']:9.1f} us  {k['calls']:5d}  {k['name'][:80]}")
            del st
            torch.cuda.empty_cache()
        res["results"][str(ctx)] = out
    res["identity"] = run_identity(torch_device("cuda", 0))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"decode-step-{res['date']}{args.tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{path}")
    print(f"{'ctx':>5} {'step':16} {'GB':>6} {'floor':>6} {'graph':>7} {'frac':>5} {'eager':>7}")
    for ctx, out in res["results"].items():
        for name, r in out.items():
            if "error" in r:
                print(f"{ctx:>5} {name:16} ERROR {r['error'][:80]}")
            else:
                print(f"{ctx:>5} {name:16} {r['bytes_GB']:6.3f} {r['floor_ms']:6.3f} {r['graph_ms']:7.3f} "
                      f"{r['graph_frac_floor']:5.2f} {r.get('eager_ms', float('nan')):7.3f}")


if __name__ == "__main__":
    sys.exit(main())
