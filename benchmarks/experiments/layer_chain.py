"""Experiment, not part of the backend: a decode layer as ONE launch (``decode_step.py --chain``).

``chain_kernels.layer_chain_kernel`` runs the o projection (+ residual add), gate/up (x = RMSNorm of the
residual), down (x = SiLU-mul of gate/up; + residual add) and the next layer's qkv (x = RMSNorm; RoPE and the
KV-cache append in its epilogue) -- or, after the last layer, the lm head -- as four phases of one persistent
grid; the decode step then launches per layer the paged attention (decode kernel + merge) and this, against the
table's step (four GEMV launches, four glue kernels, the attention). ``chain_kernels.decode_layer_kernel``
(``attention=True``) puts the layer's paged attention in the same launch as its first phase: one launch a layer.
This module is the host side: ``LayerChain`` (buffers, compile-time arguments, one launch per layer) and
``check_layer`` (layer 0 against the same layer computed by the step's own attention, torch glue and GEMVs).

    python benchmarks/experiments/layer_chain.py --phase lower    # no GPU: sm_90a lowering of the kernels
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments.chain_kernels import EPI_ROPE, EPI_STORE, decode_layer_kernel, layer_chain_kernel  # noqa: E402
from experiments.gemv_chain import check_resident, spin_error, sync_buffers  # noqa: E402

#: RMSNorm epsilon of the decode step (``decode_step.add_rmsnorm``)
EPS = 1e-5
#: columns per tile (two heads of 128: the RoPE epilogue relies on it)
BN = 256


def constexprs(shapes, programs: int, ahead: int, l2_ahead: int, epi3=None) -> dict:
    """The chain kernels' compile-time arguments for phases of ``shapes`` ((N, K) each: o, gate/up, down, phase 3
    ...) on ``programs`` programs: per phase the stream kernel's groups and x slots, shared the tile shape;
    ``EPI3`` (phase 3's epilogue) where given."""
    from portakern.backends.triton import gemv_stream as S

    c = {}
    for j, (N, K) in enumerate(shapes):
        G = K // 128
        xs, by = S.x_slots(G, -(-N // BN) * G, programs)
        c.update({f"G{j}": G, f"XS{j}": xs, f"BY{j}": by})
    c.update(TR=16, BN=BN, WR=S.WARP_ROWS, WC=8 // S.WARP_ROWS, AHEAD=ahead, IW=8, ZP=8, HAS_Z=True,
             L2_AHEAD=l2_ahead, PDL=True, SPIN_LIMIT=1 << 20, NSS=shapes[0][0] // BN, EPS=EPS)
    if epi3 is not None:
        c["EPI3"] = epi3
    return c


def start_step(step, chain, kv0):
    """The decode step's part before the chain: the first RMSNorm (its residual into ``chain.r``), layer 0's qkv
    GEMV and its RoPE with the append into the cache ``kv0`` (layer 0's, ``(2, pages, PAGE, HKV, D)``); returns
    layer 0's rotated q ``(1, 1, HQ, D)``."""
    r, xn = step.add_rmsnorm(step.h, step.zero, step.norms[0])
    chain.r.copy_(r)
    return step.rope_append(step.gemv("qkv", xn, step.layers[0]["qkv"]), step.cos, step.sin,
                            kv0.view(2, -1, kv0.shape[-2], kv0.shape[-1]), step.slot)


def attention_constexprs(seqlen: int, hq: int = 32, hkv: int = 8, page: int = 64, d: int = 128) -> dict:
    """``decode_layer_kernel``'s attention constants: heads, page, head size, the partials' page capacity (the
    pages rounded up to a power of two) and the softmax scale."""
    pages = -(-seqlen // page)
    return dict(HKV=hkv, QG=hq // hkv, PAGE=page, D=d, NPMAX=1 << (pages - 1).bit_length(), SM_SCALE=d ** -0.5)


def attention_ints(seqlen: int, hkv: int = 8, page: int = 64, d: int = 128) -> dict:
    """Launch values of ``decode_layer_kernel``'s attention integers for the decode step's cache (its pages: the
    sequence's, rounded up)."""
    return {"seqlen": seqlen, "kv_plane": -(-seqlen // page) * page * hkv * d}


class LayerChain:
    """``layer_chain_kernel`` over a ``decode_step.PortakernStep``'s weights, norms, KV caches and RoPE tables.
    ``self.r`` is the residual (fp32) the launches update; ``self.q`` the next layer's rotated q; ``self.logits``
    the lm head's output after the last layer. ``per_sm`` programs per SM (two need the stream kernel's 128
    registers: ``maxnreg``), ``ahead`` units in registers, ``l2_ahead`` units asked of the L2 before each wait.
    ``attention``: ``decode_layer_kernel`` instead, the layer's paged attention of ``self.q`` its first phase
    (``self.a`` its output; partials in ``self.part``): the whole layer one launch. ``self()`` runs the step."""

    def __init__(self, step, ahead: int = 1, per_sm: int = 2, l2_ahead: int = 0, num_sms: int | None = None,
                 attention: bool = False):
        import torch

        from portakern.backends.triton.backend import KERNEL_OPTIONS

        self.step = step
        L0 = step.layers[0]
        dims = {n: (w.N, w.K) for n, w in L0.items()}
        self.shapes_qkv = (dims["o"], dims["gu"], dims["down"], dims["qkv"])
        self.shapes_lm = self.shapes_qkv[:3] + ((step.lm.N, step.lm.K),)
        self.num_sms = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
        units = min(-(-N // BN) * (K // 128) for N, K in self.shapes_lm + self.shapes_qkv[3:])
        self.programs = min(per_sm * self.num_sms, units)
        self.consts_qkv = constexprs(self.shapes_qkv, self.programs, ahead, l2_ahead, EPI_ROPE)
        self.consts_lm = constexprs(self.shapes_lm, self.programs, ahead, l2_ahead, EPI_STORE)
        self.opts = dict(num_warps=8, launch_pdl=True, **KERNEL_OPTIONS, **({"maxnreg": 128} if per_sm > 1 else {}))
        hid, f32, bf16 = dims["o"][0], torch.float32, torch.bfloat16
        dev = step.h.device
        self.r = torch.zeros((1, hid), dtype=f32, device=dev)
        self.ss = torch.zeros((hid // BN,), dtype=f32, device=dev)
        self.gu = torch.empty((1, dims["gu"][0]), dtype=bf16, device=dev)
        self.qkv = torch.empty((1, dims["qkv"][0]), dtype=bf16, device=dev)
        self.q = torch.empty((1, dims["o"][1]), dtype=bf16, device=dev)
        self.logits = torch.empty((1, step.lm.N), dtype=bf16, device=dev)
        sync_buffers(self, -(-step.lm.N // BN), 5, dev, BN)
        self.checked = set()
        self.slot = int(step.slot.item())
        self.attention = attention
        self.kernel = decode_layer_kernel if attention else layer_chain_kernel
        if attention:
            kv = step.kv[0]                     # (2, pages, PAGE, HKV, D)
            _, _, page, hkv, d = kv.shape
            self.seqlen = int(step.seqlens.item())
            hq = dims["o"][1] // d
            att = attention_constexprs(self.seqlen, hq, hkv, page, d)
            npmax = att["NPMAX"]
            self.consts_qkv.update(att)
            self.consts_lm.update(att)
            self.part = torch.empty((hq, npmax, d + 2), dtype=f32, device=dev)
            self.a = torch.empty((1, hq * d), dtype=bf16, device=dev)
            if self.cnt.numel() < hkv:
                raise ValueError(f"{hkv} KV heads need as many arrival counters as the lm head's tiles hold")

    def _kv_rows(self, layer: int):
        """Layer ``layer``'s cache rows of the new token: k and v, ``(HKV, D)`` each (the step's slot)."""
        kv = self.step.kv[layer]
        kvf = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
        return kvf[0, self.slot], kvf[1, self.slot]

    def layer(self, i: int, a=None) -> None:
        """Launch layer ``i``'s chain on the attention output ``a`` (``(1, HQ D)`` bf16; with ``attention``: None,
        the launch attends ``self.q`` over layer ``i``'s cache itself): after the last layer phase 3 is the lm
        head (``self.logits``), else layer ``i + 1``'s qkv with RoPE and the KV append."""
        st = self.step
        L = st.layers[i]
        last = i == len(st.layers) - 1
        w3 = st.lm if last else st.layers[i + 1]["qkv"]
        o3 = self.logits if last else self.qkv
        k_row, v_row = self._kv_rows(i if last else i + 1)
        ws = (L["o"], L["gu"], L["down"], w3)
        consts = self.consts_lm if last else self.consts_qkv
        if self.attention:
            if a is not None:
                raise ValueError("a LayerChain with attention attends self.q itself: call layer(i) without a")
            kv = st.kv[i]
            tens = [self.q, kv, st.block_table[0], self.part, self.a]
        else:
            tens = [a]
        for j, w in enumerate(ws):
            tens += [w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales]
            if j == 1:
                tens.append(self.gu)
        tens += [o3, self.r, self.ss, st.norms[2 * i + 1], st.norms[2 * i + 2]]
        tens += ([] if self.attention else [self.q]) + [k_row, v_row, st.cos, st.sin]
        tens += [self.ws, self.cnt, self.done, self.exit, self.err]
        scalars = [self.seqlen, kv[0].numel()] if self.attention else []
        for w in ws:
            scalars += [w.N, -(-w.N // BN), w.stride_qk]
        args = (*tens, *scalars)
        if last not in self.checked:
            check_resident(self.kernel, args, self.programs, self.num_sms, consts, self.opts)
            self.checked.add(last)
        self.kernel[(self.programs,)](*args, **consts, **self.opts)

    def __call__(self):
        """The whole decode step: ``start_step``, then per layer one launch (with ``attention``: it attends q
        itself) or the step's paged attention and one launch; returns the logits."""
        st = self.step
        q = start_step(st, self, st.kv[0])
        if self.attention:
            self.q.copy_(q.reshape(1, -1))
        for i in range(len(st.layers)):
            if self.attention:
                self.layer(i)
            else:
                self.layer(i, st.attend(i, q))
                q = self.q.view(q.shape)
        return self.logits


def check_layer(step, chain: LayerChain) -> dict:
    """Layer 0 by the chain and by the step's own torch glue (eager) and GEMVs, from the same residual and the same
    attention output (or, with ``chain.attention``, the same q attended by ``portakern.attention`` over layer 0's
    cache): the residual after the layer, layer 1's rotated q and its new k / v rows (and the attention output).
    Returns each one's ``max |chain - torch| / max |torch|`` and whether all are below 2e-2 (bf16 roundings of
    different summation orders move values by an ulp or two; a wrong index moves them by their own size)."""
    import torch

    import decode_step as D

    torch.manual_seed(1)
    hid = chain.r.shape[1]
    r0 = torch.randn(1, hid, device="cuda")
    L0, L1 = step.layers[0], step.layers[1]
    k_row, v_row = chain._kv_rows(1)
    ref = {}
    # -- the torch step's layer
    if chain.attention:
        q0 = torch.randn(1, 1, D.HQ, D.D, device="cuda").to(torch.bfloat16)
        a = step.attend(0, q0).clone()
        ref["a"] = a.float()
    else:
        a = torch.randn(1, hid, device="cuda").to(torch.bfloat16)
    o = step.gemv("o", a, L0["o"]).clone()
    r1, xn = D.add_rmsnorm(r0, o, step.norms[1])
    gu = step.gemv("gu", xn, L0["gu"]).clone()
    d = step.gemv("down", D.silu_mul(gu), L0["down"]).clone()
    r2, xn2 = D.add_rmsnorm(r1, d, step.norms[2])
    qkv = step.gemv("qkv", xn2, L1["qkv"]).clone()
    q = D.rope_append(qkv, step.cos, step.sin, step.kv[1].view(2, -1, D.HKV, D.D), step.slot)
    ref.update(r=r2, q=q.reshape(1, -1).float(), k=k_row.float().clone(), v=v_row.float().clone())
    # -- the chain's
    k_row.fill_(float("nan"))
    v_row.fill_(float("nan"))
    chain.r.copy_(r0)
    if chain.attention:
        chain.a.fill_(float("nan"))
        chain.q.copy_(q0.reshape(1, -1))
        chain.layer(0)
    else:
        chain.q.fill_(float("nan"))
        chain.layer(0, a)
    torch.cuda.synchronize()
    got = {"r": chain.r, "q": chain.q.float(), "k": k_row.float(), "v": v_row.float()}
    if chain.attention:
        got["a"] = chain.a.float()
    out = {}
    for name, want in ref.items():
        g = got[name]
        err = ((g - want).abs().max() / want.abs().max()).item() if torch.isfinite(g).all() else float("inf")
        out[f"{name}_rel_err"] = err
    out["spin_error"] = spin_error(chain)
    out["ok"] = all(v < 2e-2 for k, v in out.items() if k.endswith("rel_err")) and out["spin_error"] == 0
    return out


def lower() -> int:
    """sm_90a lowering of the layer kernel for the decode step's shapes as a launch specialises it (no GPU),
    phase 3 = qkv (RoPE) and = lm head."""
    from experiments.chain_lowering import describe, lower_sm90, step_ints

    shapes = ((4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096))
    for name, sh, epi in (("qkv", shapes, EPI_ROPE), ("lm", shapes[:3] + ((128256, 4096),), EPI_STORE)):
        ck = lower_sm90(layer_chain_kernel, constexprs(sh, 264, 1, 0, epi), step_ints(sh), maxnreg=128)
        print(f"phase 3 = {name}: {describe(ck)}", flush=True)
        for ctx in (2048, 8192):   # the whole layer: attention first
            ck = lower_sm90(decode_layer_kernel, {**constexprs(sh, 264, 1, 0, epi), **attention_constexprs(ctx + 1)},
                            {**step_ints(sh), **attention_ints(ctx + 1)}, maxnreg=128)
            print(f"  with the attention, ctx {ctx}: {describe(ck)}", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("lower",), required=True)
    raise SystemExit(lower())
