"""Same-process variants of the decode step (``benchmarks/decode_step.py``): their command-line options, names and
construction.

A variant is portakern's step with one thing changed -- the glue's launch mode, the attention's launch options or
configuration, one linear's GEMV configuration or backend -- sharing the base step's weights and caches,
timed in the same process, its logits compared with the base step's. Sweeps re-time the table's step every 8
variants, and the A/B options alternate the table's step with the candidates for several rounds, because one process
has shown two levels ~0.04 ms apart for the same step (``benchmarks/results/step-capture-spread-h200.json``).
"""

from __future__ import annotations

import argparse
import copy

import torch

from portakern.backends.triton.common.arch import arch_family
from portakern.backends.triton.quant_gemv import aot as QA, autotune as GT
from portakern.devices import torch_device
from portakern.ir import DType, QuantFormat
from portakern.ir.ops import QuantGemv

#: ``--compare-attention``: the paged attention built by the triton backend with the table's configuration
#: changed so (``AttnConfig`` fields); "table" changes nothing (the same build path, as a control)
ATTENTION_VARIANTS = {"table": {}, "release": {"release_next": True}, "hold": {"release_next": False},
                      "release-pdl": {"release_next": True, "pdl": True},
                      "early": {"release_next": True, "early_merge": True},
                      "early-pdl": {"release_next": True, "early_merge": True, "pdl": True},
                      "late": {"release_next": True, "early_merge": False}}
#: the step's linears, as ``PortakernStep.linears`` names them
LINEARS = ("qkv", "o", "gu", "down", "lm")
#: a sweep re-times the table's step before every this many variants
CONTROL_EVERY = 8


def gemv_op(N: int, K: int) -> QuantGemv:
    """The step's int4 group-128 asymmetric bf16 GEMV of one (N, K) linear at M = 1."""
    return QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False))


def gemv_candidates(N: int, K: int) -> list:
    """The autotuner's configurations of the step's (N, K) GEMV on this GPU (the table's first)."""
    dev = torch_device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return GT.candidates(QA.LayoutStub(gemv_op(N, K)), 1, N, arch_family(dev.capability), sms)


def config_label(cfg) -> str:
    """A short name of a GEMV configuration for result keys."""
    label = f"{cfg.kind}-bn{cfg.block_n}-kw{cfg.block_kw}-w{cfg.num_warps}-s{cfg.split_k}"
    if cfg.group_rows:
        label += "-rows"
    if cfg.kind == "stream":
        label += f"-p{cfg.prefetch}-sm{cfg.per_sm}"
    return label


def attention_label(cfg) -> str:
    """A short name of an attention configuration for result keys."""
    label = f"{'ws' if cfg.decode_ws else 'fwd'}-bn{cfg.block_n}-st{cfg.num_stages}-sp{cfg.num_splits}-w{cfg.num_warps}"
    flags = [f for f in ("fused_combine", "pdl", "release_next", "early_merge") if getattr(cfg, f)]
    return label + "".join(f"-{f.split('_')[0]}" for f in flags)


def attention_spec(spec: str) -> str:
    """``--compare-attention``'s argument: ``VARIANT`` of ``ATTENTION_VARIANTS``, optionally ``+LINEAR2``."""
    variant, _, deeper = spec.partition("+")
    if variant not in ATTENTION_VARIANTS:
        raise argparse.ArgumentTypeError(f"{spec!r}: the variant is one of {', '.join(ATTENTION_VARIANTS)}")
    if deeper and (deeper[:-1] not in LINEARS[:4] or deeper[-1] != "2"):
        raise argparse.ArgumentTypeError(f"{spec!r}: after '+' comes a linear (qkv, o, gu, down) and 2, e.g. "
                                         f"{variant}+o2")
    return spec


def add_variant_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that add same-process variants of portakern's step (``variants_for`` builds them)."""
    ap.add_argument("--l2-prefetch", type=int, nargs="+", default=[], metavar="UNITS",
                    help="also time portakern's step (the same weights, in the same process) with its stream-kernel "
                         "GEMVs asking the L2 for UNITS units of words before waiting for the kernel before them "
                         "(GemvConfig.l2_prefetch), as int4_portakern_l2_prefetch_UNITS, logits compared")
    ap.add_argument("--compare-attention", nargs="+", default=[], type=attention_spec, metavar="VARIANT[+LINEAR2]",
                    help="also time portakern's step (the same weights, in the same process) with its paged attention "
                         "built under the table's configuration changed: release (the merge lets the o-projection "
                         "GEMV launch at its start, AttnConfig.release_next; the sm_90 table's choice), hold (it does not), release-pdl (and the decode kernel launched as a dependent of the "
                         "RoPE/append glue, the merge of it: AttnConfig.pdl), early (the decode kernel lets the merge "
                         "launch at its start and the merge lets the o-projection GEMV launch before its wait: "
                         "AttnConfig.early_merge; the sm_90 table's choice), late (release without early_merge), "
                         "early-pdl, table (unchanged, the same build path: a "
                         "control); '+o2': also the o-projection GEMV with two tiles of words in flight "
                         "(GemvConfig.prefetch=2, loaded before it waits); as int4_portakern_attention_VARIANT, "
                         "logits compared")
    ap.add_argument("--compare-gemv-backend", nargs="+", default=[], metavar="BACKEND",
                    help="also time portakern's step with every GEMV forced onto BACKEND's kernel for its shape "
                         "(triton: the step before the cuda backend's measured table; cuda: where it supports the "
                         "shape), as int4_portakern_gemv_backend_BACKEND, logits compared (another summation order "
                         "where the backend changes: close, not equal)")
    ap.add_argument("--fused-silu", action="store_true",
                    help="also time portakern's step without the SiLU-mul glue kernel, the down projection's GEMV "
                         "forming silu(gate) * up from the gate/up output itself (the silu_mul prologue), as "
                         "int4_portakern_abR_fused_silu, alternating with the table's step for --ab-rounds rounds, "
                         "logits compared (the activation is not rounded to bf16: close, not equal)")
    ap.add_argument("--sweep-gemv", nargs="+", default=[], choices=LINEARS, metavar="LINEAR",
                    help="also time portakern's step (same weights, same process) with LINEAR's GEMV under each of the "
                         "autotuner's configurations for its shape (quant_gemv.autotune.candidates; at most --sweep-limit), "
                         "as int4_portakern_LINEAR_<config>, with the table's step re-timed every 8 configurations "
                         "(int4_portakern_LINEAR_table_<i>: the same process drifts), logits compared")
    ap.add_argument("--sweep-limit", type=int, default=32, metavar="N",
                    help="configurations per linear in --sweep-gemv (the candidates' first N; default 32)")
    ap.add_argument("--ab-gemv", nargs="+", default=[], metavar="LINEAR:CONFIG",
                    help="also time portakern's step with LINEAR's GEMV under the candidate configuration named CONFIG "
                         "(a label that --sweep-gemv prints, e.g. down:fma-bn64-kw32-w4-s8), alternating with the "
                         "table's step for --ab-rounds rounds (int4_portakern_abR_table, int4_portakern_abR_LINEAR_CONFIG)")
    ap.add_argument("--ab-rounds", type=int, default=4, metavar="R",
                    help="rounds of --ab-gemv / --ab-attention (default 4)")
    ap.add_argument("--sweep-attention", action="store_true",
                    help="also time portakern's step with its paged attention under each of the autotuner's "
                         "configurations (attention.autotune.candidates), as int4_portakern_attn_<config>, the table's step "
                         "re-timed every 8")
    ap.add_argument("--ab-attention", nargs="+", default=[], metavar="CONFIG",
                    help="also time portakern's step with its attention under the candidate labelled CONFIG (as "
                         "--sweep-attention names it), alternating with the table's step for --ab-rounds rounds")


class FailedVariant:
    """A variant whose construction raised: timing it raises the same error again, so the step's run records it as
    that variant's error and goes on with the others (a kernel that does not compile on the device must not cost
    the whole run)."""

    def __init__(self, error: Exception):
        self.error = error

    def bytes(self):
        raise RuntimeError(f"the variant could not be built: {type(self.error).__name__}: {self.error}")

    __call__ = bytes


def _built(make):
    """``make()``, or a ``FailedVariant`` carrying what it raised (printed)."""
    try:
        return make()
    except Exception as e:
        print(f"variant not built: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return FailedVariant(e)


def _sweep(step, prefix: str, changed: list) -> dict:
    """``prefix_<label>`` for each ``(label, step)`` of ``changed``, the table's step (``prefix_table_<i>``)
    before every ``CONTROL_EVERY``."""
    out = {}
    for i, (label, st) in enumerate(changed):
        if i % CONTROL_EVERY == 0:
            out[f"{prefix}_table_{i // CONTROL_EVERY}"] = copy.copy(step)
        out[f"{prefix}_{label}"] = st
    return out


def _labelled(candidates: list, label: str, label_of, what: str):
    """The candidate whose ``label_of`` is ``label``, or an exit naming where the labels come from."""
    found = [c for c in candidates if label_of(c) == label]
    if not found:
        raise SystemExit(f"{what}: no candidate is labelled {label!r} (see the result keys of the matching sweep)")
    return found[0]


def variants_for(step, args) -> dict:
    """The variants of ``step`` (a ``decode_step.PortakernStep``) that ``args`` asks for, by result name, in the
    order they are timed."""
    variants = {}
    if args.compare_glue:
        variants[f"int4_portakern_glue_{args.compare_glue}"] = step.with_glue(args.compare_glue)
    for spec in args.compare_attention:
        variants[f"int4_portakern_attention_{spec}"] = step.with_attention(spec)
    for backend in args.compare_gemv_backend:
        variants[f"int4_portakern_gemv_backend_{backend}"] = _built(lambda b=backend: step.with_gemv_backend(b))
    for name in args.sweep_gemv:
        cands = gemv_candidates(*step.linears[name])[:args.sweep_limit]
        variants.update(_sweep(step, f"int4_portakern_{name}",
                               [(config_label(c), step.with_gemv_config(name, c)) for c in cands]))
    if args.sweep_attention:
        variants.update(_sweep(step, "int4_portakern_attn", [(attention_label(c), step.with_attention_config(c))
                                                             for c in step.attention_candidates()]))
    chosen = []
    for label in args.ab_attention:
        cfg = _labelled(step.attention_candidates(), label, attention_label, f"--ab-attention {label}")
        chosen.append((f"attn_{label}", step.with_attention_config(cfg)))
    for spec in args.ab_gemv:
        name, _, label = spec.partition(":")
        cfg = _labelled(gemv_candidates(*step.linears[name]), label, config_label, f"--ab-gemv {spec}")
        chosen.append((f"{name}_{label}", step.with_gemv_config(name, cfg)))
    if args.fused_silu:
        chosen.append(("fused_silu", step.with_fused_silu()))
    for r in range(args.ab_rounds if chosen else 0):
        variants[f"int4_portakern_ab{r}_table"] = copy.copy(step)
        variants.update({f"int4_portakern_ab{r}_{key}": copy.copy(st) for key, st in chosen})
    for units in args.l2_prefetch:
        variants[f"int4_portakern_l2_prefetch_{units}"] = step.with_l2_prefetch(units)
    return variants
