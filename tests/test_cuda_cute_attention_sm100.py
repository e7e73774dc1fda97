"""The cuda backend's Blackwell (sm_100a) CuTe DSL attention kernel (``kernels/attn_fwd_sm100.py``) without a GPU.

The kernel is compiled here, never executed (no Blackwell GPU has run it). What a CPU-only machine checks:
* ``compile_for_target(op, "sm_100a")`` lowers it through CuTe DSL for the target given per compile, and the PTX
  holds what it is written with: tcgen05 MMAs (both GEMMs, the counts of its schedule), tensor-memory allocation,
  loads, stores and fences, TMA loads; no wgmma, no register spill, an ELF cubin;
* ``supports`` serves the described sm_100a target that compile-only asks about with the same refusals as sm_90a,
  and refuses a real Blackwell GPU with the reason: an unexecuted kernel is never served.
The per-tile math it shares with the Hopper kernel is checked in ``test_cuda_cute_attention.py``.

Without CuTe DSL (``nvidia-cutlass-dsl``) these tests skip on a developer's machine but fail under ``CI``."""

import re

import pytest

from portakern.devices import Device
from portakern.ir.dtypes import DType
from portakern.ir.expr import causal_mask, softcap_score, window_mask
from portakern.ir.ops import Attention

from cuda_helpers import backend, cute_dsl_required  # noqa: F401 (fixtures: the cuda backend, CuTe DSL present)

B200 = Device("cuda", 0, arch="sm_100", name="B200 (test)", capability=(10, 0), warp_size=32)
GB300 = Device("cuda", 0, arch="sm_103", name="GB300 (test)", capability=(10, 3), warp_size=32)
H200 = Device("cuda", 0, arch="sm_90", name="H200 (test)", capability=(9, 0), warp_size=32)


def attn(D=128, dtype=DType.bfloat16, **kw):
    return Attention(batch=2, seqlen_q=300, seqlen_k=500, heads_q=8, heads_kv=2, head_dim=D,
                     head_dim_v=kw.pop("head_dim_v", D), dtype=dtype, scale=D ** -0.5, **kw)


def described(target: str) -> Device:
    """The device compile-only describes for ``target`` (what ``conformance --compile-only`` asks ``supports``)."""
    from conformance.records import target_device

    return target_device(target)


def test_a_real_blackwell_gpu_is_refused_and_the_sm100a_target_is_served(backend):
    for gpu in (B200, GB300):
        s = backend.supports(attn(), gpu)
        assert not s.ok and "compiled but has not run on a Blackwell GPU" in s.reason
        assert "backend='triton'" in s.reason
    assert backend.supports(attn(), described("sm_100a")).ok
    assert backend.supports(attn(), described("sm_90a")).ok and backend.supports(attn(), H200).ok
    # a described target without a kernel (sm_103a) is no sm_100a: refused like the real GPU
    assert not backend.supports(attn(), described("sm_103a")).ok
    from portakern.backends.cuda import attention

    assert attention.described_target(described("sm_100a")) == "sm_100a"
    assert attention.described_target(B200) is None and attention.described_target(H200) is None


@pytest.mark.parametrize("op", [attn(128, DType.float32), attn(192), attn(128, head_dim_v=64)],
                         ids=["float32", "d192", "dv-differs"])
def test_sm100a_refuses_what_sm90a_refuses_with_the_same_reason(backend, op):
    s90, s100 = (backend.supports(op, described(t)) for t in ("sm_90a", "sm_100a"))
    assert not s90.ok and not s100.ok and s90.reason == s100.reason


def test_tensor_memory_columns():
    from portakern.backends.cuda.kernels.attn_fwd_sm100 import tmem_columns

    # S (tile_n fp32 columns) then O (head_dim), rounded up to a power of two of at least 32
    assert [tmem_columns(128, d) for d in (32, 64, 96, 128)] == [256, 256, 256, 256]
    assert tmem_columns(64, 256) == 512 and tmem_columns(64, 32) == 128
    with pytest.raises(ValueError, match="512"):
        tmem_columns(128, 512)


@pytest.mark.parametrize("op", [attn(), attn(mask_mod=causal_mask(), return_lse=True), attn(64, DType.float16),
                                attn(64, DType.float16, score_mod=softcap_score(30.0), mask_mod=causal_mask()),
                                attn(256, DType.float16, mask_mod=window_mask(256, 0))],
                         ids=["bf16-d128", "bf16-d128-causal-lse", "fp16-d64", "fp16-d64-softcap-causal",
                              "fp16-d256-window"])
def test_lowers_for_sm100a_with_tcgen05_and_tensor_memory(backend, op):
    from portakern.backends.cuda.attention import TILE_N

    art = backend.compile_for_target(op, "sm_100a")
    ptx = art["ptx"]
    assert art["kernel"] == "attn_fwd_sm100" and art["target"] == "sm_100a"
    assert ".target sm_100a" in ptx and "wgmma" not in ptx
    # S = Q K^T: D/16 k-steps, issued for the first tile and for each next one in the loop; O += P V: BN/16 k-steps
    # once; all single-CTA 16-bit MMAs into tensor memory, both operands from shared-memory descriptors
    D, BN = op.head_dim, TILE_N[op.head_dim]
    assert art["tile_n"] == BN
    mma = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* \[%r\d+\], %rd\d+, %rd\d+,", ptx)
    assert len(mma) == ptx.count("tcgen05.mma") == art["tcgen05"] == 2 * (D // 16) + BN // 16
    # tensor memory: allocated and freed once; S and O read with 32x32b loads (a row a thread), O rescaled in place
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1 and ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert "tcgen05.relinquish_alloc_permit" in ptx
    assert re.search(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx)
    assert re.search(r"tcgen05\.st\.sync\.aligned\.32x32b\.x32\.b32", ptx)
    assert "tcgen05.wait::ld" in ptx and "tcgen05.wait::st" in ptx
    # the conditional rescale: a warp votes whether any of its rows' max moved before it loads and stores O
    assert ptx.count("vote.sync.any.pred") == 1
    assert "tcgen05.fence::before_thread_sync" in ptx and "tcgen05.fence::after_thread_sync" in ptx
    # each MMA's completion reaches its consumer through tcgen05.commit on an mbarrier; TMA loads Q, K and V
    assert ptx.count("tcgen05.commit") >= 4 and "cp.async.bulk.tensor" in ptx
    # P goes to shared memory 16 bytes at a time (BN / 8 vector stores a thread and tile)
    assert ptx.count("st.shared.v4.b32") == BN // 8
    assert art["frame_bytes"] == 0 and art["registers"] <= 255
    assert art["cubin"][:4] == b"\x7fELF"


def test_an_expression_heavy_specialisation_takes_narrower_key_tiles_instead_of_spilling(backend):
    """The conformance suite's bias-and-mask case (a score_mod and a mask_mod of several terms each) spills with
    128-key tiles at D = 128 (a thread holds a whole row of S); it lowers with 64-key tiles, unspilled."""
    from conformance.cases import all_cases
    from conformance.execute import static_op
    from portakern.backends.cuda.attention import SM100_NARROW_TILE_N

    case = next(c for c in all_cases() if c.id == "attn-d128-sq1-sk777-h8g8-b3-biasmask-bf16")
    art = backend.compile_for_target(static_op(case), "sm_100a")
    assert art["tile_n"] == SM100_NARROW_TILE_N and art["frame_bytes"] == 0
    assert art["tcgen05"] == 2 * (128 // 16) + SM100_NARROW_TILE_N // 16
