"""The triton-rocm backend: device detection on a HIP build of torch (faked here), dispatch on rocm devices, the
AMD launch tables, lowering to hsaco for gfx942 / gfx950 (MFMA instructions in the dot-heavy kernels), and the
kernels under Triton's CPU interpreter against float64 references.

No AMD GPU is available here: detection runs against torch with its HIP attributes monkeypatched, lowering runs
Triton's HIP backend in-process (no ROCm install needed), execution runs under ``TRITON_INTERPRET=1`` (tests marked
``interpreter``; scripts/test.sh's interpreter step). The whole cpu-tier suite runs in scripts/test.sh through
``portakern conformance --backend triton-rocm``.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from portakern.devices import Device  # noqa: E402
from portakern.ir import Attention, DType, QuantFormat  # noqa: E402
from portakern.ir.ops import QuantGemv  # noqa: E402

from triton_helpers import needs_compiler  # noqa: E402

MI300 = Device("rocm", 0, arch="gfx942", name="AMD Instinct MI300X", warp_size=64)


@pytest.fixture
def hip_torch(monkeypatch):
    """torch as a HIP build with one MI300X (``torch.version.hip`` set, ``gcnArchName`` with feature flags)."""
    from portakern.devices import torch_device

    props = types.SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-",
                                  total_memory=192 << 30, multi_processor_count=304, warp_size=64, major=9, minor=4)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    torch_device.cache_clear()
    yield props
    torch_device.cache_clear()


def test_hip_torch_device_is_rocm_with_its_gfx_arch(hip_torch):
    from portakern.devices import detect_devices, parse_device

    found = [d for d in detect_devices() if d.type == "rocm"]
    assert [str(d) for d in found] == ["rocm:0"]
    d = found[0]
    assert (d.arch, d.warp_size, d.capability) == ("gfx942", 64, None)
    info = dict(d.info)
    assert info["gcn_arch_name"] == "gfx942:sramecc+:xnack-" and info["compute_units"] == "304"
    assert info["hip"] == "6.2.41133"
    assert parse_device("rocm:0") == d
    assert d.label == "rocm:0 (AMD Instinct MI300X, gfx942)"


def test_portakern_info_lists_the_rocm_device(hip_torch, capsys):
    from portakern.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "rocm:0 (AMD Instinct MI300X, gfx942)" in out
    assert "triton-rocm" in out and "compile targets gfx942, gfx950" in out


def _attention(**kw) -> Attention:
    base = dict(batch=1, seqlen_q=64, seqlen_k=64, heads_q=4, heads_kv=4, head_dim=64, head_dim_v=64,
                dtype=DType.float16, scale=0.125)
    base.update(kw)
    return Attention(**base).verify()


def test_dispatch_picks_triton_rocm_on_a_rocm_device():
    from portakern.dispatch import decide

    plan = decide(_attention(), MI300, None)
    assert plan.order[0].name == "triton-rocm"
    refused = {c.name: c.support.reason for c in plan.decision.candidates if not c.support.ok}
    assert "triton-rocm" in refused["triton"]          # the NVIDIA backend points at the AMD one
    gemv = QuantGemv(M=1, N=256, K=512, dtype=DType.float16, fmt=QuantFormat(4, 128, False))
    assert decide(gemv, MI300, None).order[0].name == "triton-rocm"


def test_untuned_gfx_target_is_refused_with_the_way_out():
    from portakern.plugins import registry

    b = registry().backends["triton-rocm"]
    s = b.supports(_attention(), Device("rocm", 0, arch="gfx1100", name="Radeon RX 7900", warp_size=32))
    assert not s and "gfx942" in s.reason and "tuning.py" in s.reason
    s = b.supports(_attention(), Device("cuda", 0, arch="sm_90", capability=(9, 0), warp_size=32))
    assert not s and "AMD GPUs" in s.reason and "triton backend" in s.reason


def test_expressions_lower_through_the_kernels_generator_with_this_backends_files():
    """Both backends write the same score_mod / mask_mod functions for attn_fwd (one generator, beside the kernel
    body); each module's header names the backend that wrote it, and the files go to each backend's folder."""
    from portakern.backends.triton import expr_triton as T
    from portakern.backends.triton_rocm import expr_triton as R
    from portakern.ir import expr as E

    pair = (E.where(E.q_idx > 3, E.score, 1) + E.tanh(E.score), E.causal_mask() & ~(E.kv_idx.eq(E.h)))
    ours, theirs = R.generate_source(*pair), T.generate_source(*pair)
    assert ours.split('"""', 2)[2] == theirs.split('"""', 2)[2]
    assert "portakern.backends.triton_rocm.expr_triton" in ours.split("\n", 1)[0]
    assert R.analyse_mask(pair[1]) == T.analyse_mask(pair[1])
    assert R.load_mods.__self__.subdir == "triton-rocm-expr" != T.load_mods.__self__.subdir

def test_attention_limits_are_the_kernels_and_name_this_backend():
    """supports() reports the kernel's own limits (kernels.attention_args), naming triton-rocm and its target."""
    from portakern.backends.triton.kernels import attention_args
    from portakern.backends.triton_rocm import attention

    s = attention.supports(_attention(batch=40000), MI300)
    assert not s and "triton-rocm on gfx942" in s.reason and f"(at most {attention_args.MAX_GRID_Y})" in s.reason
    s = attention.supports(_attention(head_dim=320, head_dim_v=320), MI300)
    assert not s and "head_dim=320" in s.reason and "triton-rocm on gfx942" in s.reason
    assert attention.supports(_attention(), MI300)

def test_every_tuning_entry_names_its_source():
    from portakern.backends.triton_rocm import tuning

    rows = [*tuning.TARGETS.values(), *tuning.PREFILL_TILES, *tuning.DECODE_TILES, *tuning.GEMV_TILES,
            tuning.DOT_PRECISION, tuning.SPLIT_PROGRAMS_PER_CU, tuning.PROGRAMS_PER_CU]
    for row in rows:
        src = row["source"]
        assert src.startswith(("not measured", "none (the interpreter)")) or "not measured" in src, row
    assert set(tuning.COMPILE_TARGETS) <= set(tuning.TARGETS)
    for row in (*tuning.PREFILL_TILES, *tuning.DECODE_TILES, *tuning.GEMV_TILES):
        assert (row["hip"] == {}) == (row["target"] == "interp"), row   # the interpreter takes no HIP options


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "gfx90a"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_attention_plans_fit_the_targets_lds(target, D):
    from portakern.backends.triton_rocm import tuning
    from portakern.backends.triton_rocm.common import plan as P

    for op in (_attention(head_dim=D, head_dim_v=D, seqlen_q=4096, seqlen_k=4096),
               _attention(head_dim=D, head_dim_v=D, dtype=DType.float32, seqlen_q=4096, seqlen_k=4096),
               _attention(head_dim=D, head_dim_v=D, seqlen_q=1, seqlen_k=32768, heads_q=32, heads_kv=8)):
        p = P.attention(op, target)
        assert P.lds_bytes(op, p.block_m, p.block_n, p.num_stages) <= tuning.TARGETS[target]["lds"], p
        assert 1 <= p.num_splits <= tuning.MAX_SPLITS
    decode = P.attention(_attention(head_dim=D, head_dim_v=D, seqlen_q=1, seqlen_k=32768, heads_q=32, heads_kv=8),
                         target)
    assert decode.pack == 4 and decode.num_splits > 1      # 8 KV heads x 1 tile fill few of the CUs: split


def test_gemv_plans_never_choose_nvidia_only_kernels():
    from portakern.backends.triton_rocm.common import plan as P
    from portakern.backends.triton_rocm.quant_gemv import LayoutStub

    for M in range(1, 17):
        for fmt in (QuantFormat(4, 128, False), QuantFormat(8, 64, True), QuantFormat(4, 32, True)):
            op = QuantGemv(M=M, N=4096, K=4096, dtype=DType.bfloat16, fmt=fmt)
            p = P.gemv(LayoutStub(op), M, op.N, "gfx942")
            assert p.kind == ("fma" if M == 1 else "dot"), (M, p)
            assert p.block_n <= 128 and p.split_k <= 8 and p.dq == 2


def test_compile_for_target_refuses_nvidia_and_unknown_targets():
    from portakern.backends.triton_rocm import attention, quant_gemv
    from portakern.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="gfx942, gfx950"):
        attention.compile_for_target(_attention(), "sm_90a")
    op = QuantGemv(M=1, N=64, K=128, dtype=DType.float16, fmt=QuantFormat(4, 64, False))
    with pytest.raises(UnsupportedError, match="gfx942, gfx950"):
        quant_gemv.compile_for_target(op, "gfx1100")


def _mfma(asm: str) -> int:
    return sum(1 for line in asm.splitlines() if line.strip().startswith("v_mfma"))


@needs_compiler
@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_dot_heavy_kernels_lower_to_mfma(target):
    """Prefill attention (two ``tl.dot`` per key tile) and the M=16 GEMV (``tl.dot`` over a 16-row tile) lower to
    hsaco whose AMDGCN assembly holds MFMA instructions; the M=1 GEMV (vector FMAs) holds none."""
    from portakern.backends.triton_rocm import attention, quant_gemv

    art = attention.compile_for_target(_attention(seqlen_q=256, seqlen_k=256), target)
    fwd = art["kernels"]["attn_fwd"]
    assert fwd["hsaco"][:4] == b"\x7fELF"
    target_line = next(line for line in fwd["amdgcn"].splitlines() if ".amdgcn_target" in line)
    assert target_line.rstrip().endswith(f"-{target}\""), target_line
    assert _mfma(fwd["amdgcn"]) >= 2, "no v_mfma in the attention kernel"
    for M, kind, mfma in ((16, "gemv_dot_kernel", True), (1, "gemv_fma_kernel", False)):
        op = QuantGemv(M=M, N=1024, K=1024, dtype=DType.float16, fmt=QuantFormat(4, 128, False))
        k = quant_gemv.compile_for_target(op, target)["kernels"][kind]
        assert k["hsaco"][:4] == b"\x7fELF"
        assert (_mfma(k["amdgcn"]) > 0) == mfma, (M, kind)


@needs_compiler
def test_split_decode_lowers_both_kernels_with_the_tables_hip_options():
    from portakern.backends.triton_rocm import attention

    op = _attention(seqlen_q=1, seqlen_k=8192, heads_q=32, heads_kv=8, return_lse=True)
    art = attention.compile_for_target(op, "gfx942")
    assert art["config"]["num_splits"] > 1 and set(art["kernels"]) == {"attn_fwd", "attn_combine"}
    opts = art["kernels"]["attn_fwd"]["options"]
    assert opts["waves_per_eu"] == 2 and opts["matrix_instr_nonkdim"] == 16
    assert ".amdhsa_wavefront_size32" not in art["kernels"]["attn_fwd"]["amdgcn"]   # wave64


# -- the kernels under Triton's interpreter ---------------------------------------------------------------------

def _reference(q, k, v, scale, causal):
    q, k, v = (t.double().numpy() for t in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        Sq, Sk = s.shape[-2:]
        s = np.where(np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.interpreter
@pytest.mark.parametrize("Sq,Sk,causal", [(37, 53, True), (1, 300, False)])
def test_interpreter_attention_matches_float64(Sq, Sk, causal):
    """Prefill and split decode (the separate merge launch AMD uses) against a float64 numpy reference, on
    NaN-poisoned outputs."""
    from portakern.backends.triton_rocm import attention
    from portakern.devices import CPU
    from portakern.ir.expr import causal_mask

    op = _attention(seqlen_q=Sq, seqlen_k=Sk, heads_q=4, heads_kv=2, head_dim=32, head_dim_v=32,
                    dtype=DType.float32, scale=1 / math.sqrt(32), mask_mod=causal_mask() if causal else None)
    g = torch.Generator().manual_seed(0)
    s = op.shapes()
    q, k, v = (torch.randn(s[n], generator=g) for n in ("q", "k", "v"))
    out = torch.full(s["out"], float("nan"))
    kern = attention.compile(op, CPU)
    kern(q, k, v, out, None, {})
    assert (kern.config.num_splits > 1) == (Sq == 1)
    ref = _reference(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), op.scale, causal)
    assert not torch.isnan(out).any()
    assert np.abs(out.double().numpy() - ref).max() < 2e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("M", [1, 5])
def test_interpreter_gemv_matches_float64(M):
    """The "fma" (M=1) and "dot" (M=5) kernels against ``x @ dequant(W).T`` in float64."""
    from portakern.backends.triton_rocm import quant_gemv
    from portakern.devices import CPU
    from portakern.quantize import quantize

    N, K = 72, 256
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    qw = quantize(w, bits=4, group_size=64)
    op = QuantGemv(M=M, N=N, K=K, dtype=DType.float32, fmt=qw.fmt)
    x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
    out = torch.full((M, N), float("nan"))
    kern = quant_gemv.compile(op, CPU)
    kern(x, quant_gemv.prepare_weight(qw, CPU), out)
    ref = x.double().numpy() @ qw.dequantize().astype(np.float64).T
    assert next(iter(kern.launchers.values())).kind == ("fma" if M == 1 else "dot")
    assert np.abs(out.double().numpy() - ref).max() <= 1e-4 * np.abs(ref).max()


def test_gfx_targets_are_usage_errors_only_without_triton_rocm():
    from portakern.conformance.cli import _unknown_target

    assert _unknown_target(["triton-rocm"], ["gfx942,gfx950"]) is None
    assert _unknown_target(["triton", "triton-rocm"], ["sm_90a,gfx942"]) is None
    why = _unknown_target(["triton"], ["gfx942"])
    assert why.startswith("--target gfx942: no selected backend compiles for it") and "sm_90a" in why
