"""The decode steps ``benchmarks/decode_step.py`` times: portakern's (``PortakernStep``: int4 GEMVs through the kernel
``torch.ops.portakern.quant_gemv`` picks, paged ``portakern.attention``, torch glue) and the plain-PyTorch peers'
(``TorchStep``: bf16 ``F.linear`` or tinygemm int4, SDPA on a dense cache, eager glue), with the same-process
variants of portakern's step that ``step_variants.py`` asks for."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from gemv_problems import random_prepared  # benchmarks/ is the script's folder
from step_glue import (BF16, D, HID, HKV, HQ, LAYERS, MLP, PAGE, VOCAB, add_rmsnorm, glue_functions, rope,
                       silu_mul)
from step_variants import ATTENTION_VARIANTS, gemv_op
from portakern.backends.triton import quant_gemv as Q
from portakern.backends.triton.common.arch import arch_family
from portakern.backends.triton.quant_gemv import aot as QA, config as T
from portakern.devices import torch_device


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
    cfg = T.choose(QA.LayoutStub(op), 1, N, arch_family(dev.capability), sms, group_rows=group_rows,
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
    """portakern's step at ``ctx`` keys of cache with its glue run as ``glue``; ``attention`` "portakern" (paged) or
    "sdpa" (torch SDPA on a dense cache, where the triton backend cannot serve the paged op)."""

    def __init__(self, ctx: int, glue: str, attention: str, group_rows: bool = True):
        shapes = {"qkv": ((HQ + 2 * HKV) * D, HID), "o": (HID, HQ * D), "gu": (2 * MLP, HID), "down": (HID, MLP)}
        self.linears = {**shapes, "lm": (VOCAB, HID)}
        # the GEMVs: the kernels portakern's op picks per linear (group_rows=False: the triton table without
        # group-resident tiles, --compare-tiles); which backend each runs on is recorded with the results
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
        self.attn_kernel = self.attn_out = None   # portakern.attention's choice unless with_attention
        self.add_rmsnorm, self.rope, self.rope_append, self.silu_mul = glue_functions(glue)
        if attention == "sdpa":  # dense (B, Hkv, S, D) caches instead of pages
            self.dense = [torch.randn(2, 1, HKV, ctx + 1, D, device="cuda", dtype=BF16) for _ in range(LAYERS)]
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
        from portakern.backends.triton.attention import plan

        variant, _, deeper = spec.partition("+")
        op, device = self.attention_op()
        other = self.with_attention_config(replace(plan.for_device(op, device), **ATTENTION_VARIANTS[variant]))
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
        from portakern.backends.triton.attention import forward

        op, device = self.attention_op()
        other = copy.copy(self)
        other.attn_kernel = forward.build(op, device, cfg)
        other.attn_out = torch.empty(1, 1, HQ, D, device="cuda", dtype=BF16)
        return other

    def attention_candidates(self) -> list:
        """The autotuner's configurations of the step's paged attention on this GPU (the table's first)."""
        from portakern.backends.triton.attention import autotune, plan

        op, device = self.attention_op()
        return autotune.candidates(op, *plan.family(device))

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

    def with_glue(self, glue: str, deterministic: bool = False) -> "PortakernStep":
        """The same step (weights, caches, buffers shared) with its glue run as ``glue``."""
        other = copy.copy(self)
        other.add_rmsnorm, other.rope, other.rope_append, other.silu_mul = glue_functions(glue, deterministic)
        return other

    def gemv(self, name, x, w):
        """``x @ dequant(w)^T`` by the linear ``name``'s kernel, into the step's output buffer for it."""
        out = self.out[name]
        self.kern[name](x, w, out)
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
        r, xn = self.add_rmsnorm(self.h, self.zero, self.norms[0])
        for i, L in enumerate(self.layers):
            a = self.rope_attend(i, self.gemv("qkv", xn, L["qkv"]))
            o = self.gemv("o", a, L["o"])
            r, xn = self.add_rmsnorm(r, o, self.norms[2 * i + 1])
            gu = self.gemv("gu", xn, L["gu"])
            act = gu if self.fused_silu else self.silu_mul(gu)
            d = self.gemv("down", act, L["down"])
            r, xn = self.add_rmsnorm(r, d, self.norms[2 * i + 2])
        return self.gemv("lm", xn, self.lm)

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
        """Bytes one step must read: the int4 weights with their fp16 scales and zeros, and the K / V cache."""
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
        """Bytes one step must read: the weights (bf16, or int4 with bf16 scales and zeros) and the K / V cache."""
        lin = [((HQ + 2 * HKV) * D, HID), (HID, HQ * D), (2 * MLP, HID), (HID, MLP)]
        n = LAYERS * sum(N * K for N, K in lin) + VOCAB * HID
        w = 2 * n if self.kind == "bf16" else n // 2 + n // 128 * 4
        return w + LAYERS * 2 * (self.ctx + 1) * HKV * D * 2
