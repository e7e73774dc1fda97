"""Experiment, not part of the backend: every layer of the decode step in ONE launch (``decode_step.py --chain
A,P,L,step``).

``chain_kernels.decode_step_kernel`` loops over the layers inside one persistent grid, each layer
``decode_layer_kernel``'s five phases (attention, o, gate/up, down, next qkv with RoPE and the KV append; the lm
head after the last): the step is then the first qkv with its glue and one launch. The kernel steps through the
layers by stride, so ``StepChain`` keeps stacked copies of a ``decode_step.PortakernStep``'s weights, norms and KV
caches (same values: its logits are compared bit for bit with ``LayerChain(attention=True)``'s, which runs the same
phases one launch a layer on the step's own tensors -- ``check_step``).

    python benchmarks/experiments/step_chain.py --phase lower    # no GPU: sm_90a lowering at ctx 2048 and 8192
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments.chain_kernels import decode_step_kernel  # noqa: E402
from experiments.gemv_chain import check_resident, spin_error, sync_buffers  # noqa: E402
from experiments.layer_chain import BN, attention_constexprs, constexprs, start_step  # noqa: E402

#: the order of the kernel's shape sets: o, gate/up, down, qkv, lm head
LINEARS = ("o", "gu", "down", "qkv")


def step_constexprs(shapes, programs: int, ahead: int, l2_ahead: int, seqlen: int, hq: int = 32, hkv: int = 8,
                    page: int = 64, d: int = 128) -> dict:
    """``decode_step_kernel``'s compile-time arguments: ``layer_chain.constexprs`` for the five shape sets (o,
    gate/up, down, qkv, lm head) on ``programs`` programs, and the attention's constants."""
    return {**constexprs(shapes, programs, ahead, l2_ahead), **attention_constexprs(seqlen, hq, hkv, page, d)}


class StepChain:
    """``decode_step_kernel`` over stacked copies of ``step``'s layers (weights, norms, KV caches); ``self()`` runs
    the whole step (the first qkv and its glue by the step's own kernels, then one launch) and returns the
    logits."""

    def __init__(self, step, ahead: int = 1, per_sm: int = 2, l2_ahead: int = 0, num_sms: int | None = None):
        import torch

        from portakern.backends.triton.backend import KERNEL_OPTIONS

        self.step = step
        L0 = step.layers[0]
        self.shapes = tuple((L0[n].N, L0[n].K) for n in LINEARS) + ((step.lm.N, step.lm.K),)
        self.num_sms = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
        units = min(-(-N // BN) * (K // 128) for N, K in self.shapes)
        self.programs = min(per_sm * self.num_sms, units)
        kv0 = step.kv[0]
        _, _, page, hkv, d = kv0.shape
        self.seqlen = int(step.seqlens.item())
        hid, hq = self.shapes[0][0], self.shapes[0][1] // d
        self.consts = step_constexprs(self.shapes, self.programs, ahead, l2_ahead, self.seqlen, hq, hkv, page, d)
        self.opts = dict(num_warps=8, launch_pdl=True, **KERNEL_OPTIONS, **({"maxnreg": 128} if per_sm > 1 else {}))
        # -- stacked copies: linear X of every layer in one tensor each
        self.stack = {}
        for n in LINEARS:
            ws = [L[n] for L in step.layers]
            self.stack[n] = tuple(torch.stack([getattr(w, a) if getattr(w, a) is not None else w.scales for w in ws])
                                  for a in ("qweight", "scales", "zeros"))
        self.norms = torch.stack(step.norms)
        self.kv = torch.stack(step.kv)                     # (layers, 2, pages, PAGE, HKV, D)
        f32, bf16, dev = torch.float32, torch.bfloat16, step.h.device
        npmax = self.consts["NPMAX"]
        self.r = torch.zeros((1, hid), dtype=f32, device=dev)
        self.ss = torch.zeros((hid // BN,), dtype=f32, device=dev)
        self.gu = torch.empty((1, self.shapes[1][0]), dtype=bf16, device=dev)
        self.qkv = torch.empty((1, self.shapes[3][0]), dtype=bf16, device=dev)
        self.q = torch.empty((1, hq * d), dtype=bf16, device=dev)
        self.a = torch.empty((1, hq * d), dtype=bf16, device=dev)
        self.part = torch.empty((hq, npmax, d + 2), dtype=f32, device=dev)
        self.logits = torch.empty((1, step.lm.N), dtype=bf16, device=dev)
        sync_buffers(self, max(-(-step.lm.N // BN), hkv), 5 * len(step.layers), dev, BN)
        self.slot = int(step.slot.item())
        self.checked = False

    def launch(self) -> None:
        """The one launch: every layer from the chain's q (layer 0's, rotated) and residual ``self.r``."""
        st, kv = self.step, self.kv
        lm_z = st.lm.zeros if st.lm.zeros is not None else st.lm.scales
        tens = [self.q, kv, st.block_table[0], self.part, self.a]
        for n in LINEARS:
            tens += list(self.stack[n]) + ([self.gu] if n == "gu" else [])
        tens += [self.qkv, st.lm.qweight, st.lm.scales, lm_z, self.logits, self.r, self.ss, self.norms, st.cos, st.sin,
                 self.ws, self.cnt, self.done, self.exit, self.err]
        ints = [len(st.layers), self.seqlen, kv[0, 0].numel(), kv[0].numel(), self.slot * kv.shape[-2] * kv.shape[-1],
                self.norms.shape[1]]
        for n in LINEARS:                                  # a layer's words, a layer's scales and zeros
            qw, sc, _ = self.stack[n]
            ints += [qw.stride(0), sc.stride(0)]
        row_strides = [self.stack[n][0].shape[2] for n in LINEARS] + [st.lm.stride_qk]
        for (N, _), sq in zip(self.shapes, row_strides):
            ints += [N, -(-N // BN), sq]
        args = (*tens, *ints)
        if not self.checked:
            check_resident(decode_step_kernel, args, self.programs, self.num_sms, self.consts, self.opts)
            self.checked = True
        decode_step_kernel[(self.programs,)](*args, **self.consts, **self.opts)

    def __call__(self):
        """The whole decode step: ``start_step`` (on the stacked cache), then one launch; returns the logits."""
        self.q.copy_(start_step(self.step, self, self.kv[0]).reshape(1, -1))
        self.launch()
        return self.logits


def check_step(step, chain: StepChain, ahead: int, per_sm: int, l2_ahead: int) -> dict:
    """The one-launch step against ``LayerChain(attention=True)`` (the same phases, a launch a layer, on the step's
    own tensors) from the same state: their logits must be bit-equal (same grid, same partials, same orders)."""
    import torch

    torch.cuda.synchronize()
    per_layer = step.with_chain(ahead, per_sm, l2_ahead, mode="attn", check=False)
    chain.kv.copy_(torch.stack(step.kv))             # both from the step's caches as they are now
    want = per_layer().float().clone()
    got = chain().float().clone()
    torch.cuda.synchronize()
    out = {"logits_bit_equal": bool(torch.equal(got, want)), "logits_max_abs_diff": (got - want).abs().max().item(),
           "finite": bool(torch.isfinite(got).all()), "spin_error": spin_error(chain),
           "per_layer_spin_error": spin_error(per_layer.chain)}
    out["ok"] = out["logits_bit_equal"] and out["finite"] and out["spin_error"] == 0
    return out


def lower_ints(shapes, ctx: int, layers: int = 32, hkv: int = 8, page: int = 64, d: int = 128) -> dict:
    """Launch values of ``decode_step_kernel``'s integers for the decode step's stacked layout at context ``ctx``."""
    from experiments.chain_lowering import step_ints
    from experiments.layer_chain import attention_ints

    ints = {**step_ints(shapes), **attention_ints(ctx + 1, hkv, page, d)}
    pages = -(-(ctx + 1) // page)
    plane = pages * page * hkv * d
    ints.update(layers=layers, kv_layer=2 * plane, slot_off=(ctx % page + (pages - 1) * page) * hkv * d,
                hid=shapes[0][0])
    for n, (N, K) in zip("OGDQ", shapes):
        npad, kwp = -(-N // 128) * 128, -(-(K // 8) // 64) * 64
        ints.update({f"LW{n}": kwp * npad, f"LS{n}": (K // 128) * npad})
    return ints


def lower() -> int:
    """sm_90a lowering of the one-launch step for the decode step's shapes at ctx 2048 and 8192 (no GPU)."""
    from experiments.chain_lowering import describe, lower_sm90

    shapes = ((4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096), (128256, 4096))
    for ctx in (2048, 8192):
        ck = lower_sm90(decode_step_kernel, step_constexprs(shapes, 264, 1, 0, ctx + 1), lower_ints(shapes, ctx),
                        maxnreg=128)
        print(f"ctx {ctx}: {describe(ck)}", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("lower",), required=True)
    raise SystemExit(lower())
