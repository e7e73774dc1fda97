"""The triton backend's quantized GEMV: every packing, dtypes, M, split-K, dequant variants.

On a CPU machine the kernels run under Triton's interpreter: ``test_interpreter_matches_float64_and_cpu`` is
marked ``interpreter`` (scripts/test.sh's interpreter step, TRITON_INTERPRET=1) and checks each case of
``gemv_cases`` against an independent float64 numpy ``x @ dequant(W).T`` and against the cpu reference backend;
``test_compile_for_targets`` lowers for sm_80 / sm_90a / sm_100a with Triton's compiler (``needs_compiler``). On a
CUDA machine the ``gpu`` tests run the same packings on the device and capture quant_gemv (and attention, where
the triton backend supports it) in a CUDA graph replayed with new inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemv_cases import (CASES, COMPILE_CASES, FRAG_CASES, TARGETS, check_graph_replays, run_case,  # noqa: E402
                        run_compile, weight)

from portakern.gemv_weight import prepare_gemv_weight  # noqa: E402
from portakern.ir import gemv_layout  # noqa: E402

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from triton_helpers import needs_compiler  # noqa: E402


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreter_matches_float64_and_cpu(case):
    r = run_case(case)
    assert r["nan"] == 0, f"{r['nan']} outputs unwritten or NaN"
    assert r["err"] <= r["tol"], f"max|out - float64| / max|ref| = {r['err']:.3g} > {r['tol']}"
    assert r["err_cpu"] <= 2 * r["tol"], f"max|out - cpu backend| / max|ref| = {r['err_cpu']:.3g}"


@needs_compiler
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_compile_for_targets(case):
    r = run_compile(case)
    targets = case[7] if len(case) > 7 else TARGETS
    assert sorted(r["targets"]) == sorted(targets)
    for t in targets:
        art = r["targets"][t]
        assert art["cubin_bytes"] > 1000, f"{t}: no cubin"
        assert art["mma"] == (art["kind"] in ("dot", "mma", "frag")), f"{t}: tensor-core instructions present={art['mma']}"
        if case[0].startswith("frag"):
            assert art["kind"] == "frag", f"{t}: the table chose {art['kind']}"
        pdl = art["pdl"]   # forced by the case, or the target's table choice
        if len(case) > 6 and "pdl" in case[6]:
            assert pdl == case[6]["pdl"]
        assert art["waits"] == int(pdl), f"{t}: {art['waits']} griddepcontrol.wait"
        assert art["writes_before_wait"] == 0, f"{t}: stores before griddepcontrol.wait"
        if pdl and art["kind"] == "fma" and art["num_stages"] == 1:
            # the first weight tiles (16-byte word / scale vectors) are requested before the wait, x after it
            assert art["wide_loads_before_wait"] > 0
            assert art["loads_before_wait"] == art["wide_loads_before_wait"], art
        elif pdl and art["kind"] == "frag":
            # the first chunk's words (two 16-byte vectors per unit a lane holds) and its scales and zeros are
            # requested before the wait; x (16-byte tiles too) only after it
            units_per_warp = art["block_n"] // (16 * art["num_warps"])
            assert art["wide_loads_before_wait"] == 2 * units_per_warp, art
            assert art["loads_before_wait"] > art["wide_loads_before_wait"], art
        elif pdl:
            assert art["loads_before_wait"] == 0, art


@needs_compiler
@pytest.mark.parametrize("default_fusion", ["0", "1"])
def test_kernels_are_compiled_with_fused_multiply_adds_whatever_tritons_default(default_fusion, monkeypatch):
    """The backend states ``enable_fp_fusion`` (``backend.KERNEL_OPTIONS``): with Triton's default
    turned off (``TRITON_DEFAULT_FP_FUSION=0``, the default from Triton 3.10) the GEMV still gets one
    fused multiply-add per code (a separate multiply and add would double its instructions). Triton reads the
    variable when it compiles, so setting it for this test is enough."""
    import re

    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", default_fusion)
    op = QuantGemv(M=1, N=4096, K=4096, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128,
                                                                               symmetric=False))
    ptx = Q.compile_for_target(op, "sm_90a")["kernels"]["gemv_fma_kernel"]["ptx"]
    fma, mul = len(re.findall(r"\bfma\.rn\.f32", ptx)), len(re.findall(r"\bmul\.rn\.f32", ptx))
    assert fma >= 64 * 8 // 4, (fma, mul)        # the table tile: >= 128 codes per thread, one fma each
    assert mul < fma // 4, (fma, mul)


def test_compile_for_target_rejects_unknown_target():
    from portakern.backends.triton import quant_gemv as Q
    from portakern.errors import UnsupportedError
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=1, N=64, K=128, dtype=DType.float16, fmt=QuantFormat(4, 64, False))
    with pytest.raises(UnsupportedError, match="sm_90a"):
        Q.compile_for_target(op, "sm_75")


def test_unknown_dq_variant_is_rejected():
    from portakern.backends.triton.quant_gemv import config as T

    lay = type("L", (), {})()
    assert T.fit(T.GemvConfig("fma", 32, 64, dq=3), lay, 1).dq == 3
    with pytest.raises(ValueError, match="dq"):
        T.fit(T.GemvConfig("fma", 32, 64, dq=7), lay, 1)


def test_swap_ab_only_on_the_tensor_core_kernel():
    from portakern.backends.triton.quant_gemv import config as T

    lay = type("L", (), {})()
    assert T.fit(T.GemvConfig("dot", 64, 32, swap_ab=True), lay, 16).swap_ab
    with pytest.raises(ValueError, match="swap_ab.*kind='dot'"):
        T.fit(T.GemvConfig("fma", 32, 64, swap_ab=True), lay, 1)


def test_prefetch_depth_is_checked():
    from portakern.backends.triton.quant_gemv import config as T

    lay = type("L", (), {})()
    assert T.fit(T.GemvConfig("fma", 32, 64, prefetch=2), lay, 1).prefetch == 2
    for bad in (T.GemvConfig("fma", 32, 64, prefetch=3), T.GemvConfig("dot", 64, 32, prefetch=2)):
        with pytest.raises(ValueError, match=r"prefetch=.*prefetch is 1, or 2 for the CUDA-core kernel"):
            T.fit(bad, lay, 1)


def test_pdl_is_refused_where_it_cannot_run():
    """Programmatic dependent launch needs sm_90+ and a compiled kernel: sm_80 lowering and the
    interpreter (cpu device) are refused with the rule and the way out."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig
    from portakern.devices import Device
    from portakern.ir import DType, QuantFormat
    from portakern.ir.ops import QuantGemv

    op = QuantGemv(M=1, N=64, K=128, dtype=DType.float16, fmt=QuantFormat(4, 64, False))
    cfg = GemvConfig("fma", 32, 64, pdl=True)
    with pytest.raises(ValueError, match=r"GemvConfig\(pdl=True\) on sm_80: .*sm_90.*use pdl=False"):
        Q.compile_for_target(op, "sm_80", cfg)
    with pytest.raises(ValueError, match=r"GemvConfig\(pdl=True\) on interp: .*not the interpreter.*use pdl=False"):
        Q.compile(op, Device("cpu"), cfg)


def test_supports_every_packing_and_names_the_rule():
    from portakern.backends.triton import kernels
    from portakern.backends.triton import quant_gemv as Q
    from portakern.devices import CPU, Device
    from portakern.ir import DType
    from portakern.ir.ops import QuantGemv

    h200 = Device("cuda", 0, arch="sm_90", capability=(9, 0), warp_size=32)
    for case in CASES:
        w = weight(case)
        op = QuantGemv(M=case[5], N=w.N, K=w.K, dtype=DType(case[8]), fmt=w.fmt)
        assert Q.supports(op, h200), case[0]
    # on the CPU only Triton's interpreter runs kernels; the answer says how to get it
    on_cpu = Q.supports(op, CPU)
    assert bool(on_cpu) == kernels.interpreted()
    if not on_cpu:
        assert "TRITON_INTERPRET=1" in on_cpu.reason


def test_internal_layout_round_trip():
    """The repacked words, scales and zeros give back the reference dequantization."""
    from portakern.devices import CPU
    from portakern.ir.packing import dequantize

    for case in CASES:
        w = weight(case)
        p = prepare_gemv_weight(w, CPU)
        codes = gemv_layout.unpack_internal(p.qweight.numpy(), p.bits, p.interleave, p.N, p.K).astype(np.float64)
        k = np.arange(p.K)
        g = p.kgroup.numpy() if p.kgroup is not None else k // p.group_size
        s = p.scales.float().numpy()[g, : p.N].T
        z = p.zeros.float().numpy()[g, : p.N].T if p.zeros is not None else p.zero_point
        deq = (codes - z) * s
        if p.perm is not None:
            deq_ref = dequantize(w.fmt, w.tensors, w.N, w.K)[:, p.perm.numpy()]
        else:
            deq_ref = dequantize(w.fmt, w.tensors, w.N, w.K)
        np.testing.assert_array_equal(deq, deq_ref, err_msg=case[0])


def test_internal_layout_interleaves_word_rows_within_groups():
    """Code e of word row j is column (j // iw) * iw * epw + e * iw + j % iw of K (checked bit by bit
    against that formula, not through ``unpack_internal``); iw is, for int4, the largest power of two
    up to 8 dividing the words per group, 1 for int8 and for groups that are not whole words or
    irregular."""
    assert [gemv_layout.interleave_words(4, g, False) for g in (128, 64, 32, 16, 8, 296, 12)] == [8, 8, 4, 2, 1, 1, 1]
    assert [gemv_layout.interleave_words(8, g, False) for g in (128, 32, 8, 6)] == [1, 1, 1, 1]   # int8: plain order
    assert gemv_layout.interleave_words(4, 128, True) == 1
    rng = np.random.default_rng(0)
    for bits, iw in ((4, 8), (4, 4), (8, 8), (4, 1)):
        N, K = 3, 200
        codes = rng.integers(0, 1 << bits, (N, K))
        words = gemv_layout.pack_internal(codes, bits, iw).view(np.uint32)
        epw = 32 // bits
        kwp = -(-(-(-K // epw)) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
        assert words.shape == (kwp, gemv_layout.N_ALIGN_WORDS)
        for j in range(words.shape[0]):
            for e in range(epw):
                k = (j // iw) * iw * epw + e * iw + j % iw
                got = (words[j, :N] >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1)
                np.testing.assert_array_equal(got, codes[:, k] if k < K else 0, err_msg=f"bits={bits} iw={iw} j={j} e={e}")
        np.testing.assert_array_equal(gemv_layout.unpack_internal(words.view(np.int32), bits, iw, N, K), codes)


# -- on a CUDA device ------------------------------------------------------------------------------

def _cuda_devices():
    from portakern.devices import detect_devices

    return [d for d in detect_devices() if d.type == "cuda"]


GPU = _cuda_devices()
gpu_param = pytest.mark.parametrize("dev", GPU or [None], ids=[str(d) for d in GPU] or ["no-cuda-device"])


def _need(dev):
    if dev is None:
        pytest.skip("no CUDA device on this machine: the GPU path is covered by the interpreter tests above")


#: cases that force a launch configuration (the default-path GPU test would only repeat others)
FORCED = [c for c in CASES if "config" in c[9]]


@gpu_param
@pytest.mark.parametrize("case", [c for c in CASES if c not in FORCED or "dq3" not in c[0]],
                         ids=[c[0] for c in CASES if c not in FORCED or "dq3" not in c[0]])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_every_packing(dev, case, dtype):
    _need(dev)
    import portakern
    from portakern.ir.packing import dequantize

    from gemv_cases import reference_input

    w = weight(case)
    wd = w.with_tensors({k: torch.as_tensor(v).to(f"cuda:{dev.index}") for k, v in w.tensors.items()})
    M, K, prologue = case[5], case[7], case[9].get("prologue")
    x = torch.randn(M, 2 * K if prologue else K, device=f"cuda:{dev.index}").to(getattr(torch, dtype))
    ref = reference_input(x.double().cpu().numpy(), prologue, K) @ dequantize(w.fmt, w.tensors, w.N, w.K).T
    with portakern.dispatch.poison_outputs():
        y = portakern.quant_gemv(x, wd, prologue=prologue, backend="triton")
    err = np.abs(y.double().cpu().numpy() - ref).max() / (np.abs(ref).max() or 1)
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert err <= tol, f"{case[0]} {dtype}: {err:.3g}"


@gpu_param
@pytest.mark.parametrize("case", FORCED, ids=[c[0] for c in FORCED])
def test_gpu_forced_config(dev, case):
    """The forced configurations (dequant variants, split-K) on the device, in the case's dtype: dq=3
    relies on the FFMA keeping subnormal operands, which only the hardware can show."""
    _need(dev)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    from gemv_cases import TOL, forced_config, reference_input

    w = weight(case)
    M, K, dt, extra = case[5], case[7], case[8], case[9]
    prologue = extra.get("prologue")
    x = (torch.randn(M, 2 * K if prologue else K, device=f"cuda:{dev.index}", dtype=torch.float64)
         * extra.get("xscale", 1.0)).to(getattr(torch, dt))
    wd = w.with_tensors({k: torch.as_tensor(v).to(f"cuda:{dev.index}") for k, v in w.tensors.items()})
    op, _ = quant_gemv_op(x, wd, prologue)
    kern = Q.compile(op, dev, forced_config(extra["config"], num_warps=4))
    p = prepare_gemv_weight(w, dev)
    out = torch.full((M, w.N), float("nan"), device=x.device, dtype=x.dtype)
    ref = reference_input(x.double().cpu().numpy(), prologue, K) @ dequantize(w.fmt, w.tensors, w.N, w.K).T
    for _ in range(2):   # twice: split-K counters reset themselves
        out.fill_(float("nan"))
        kern(x, p, out)
        err = np.abs(out.double().cpu().numpy() - ref).max() / (np.abs(ref).max() or 1)
        assert err <= TOL[dt], f"{case[0]}: {err:.3g}"


@gpu_param
@pytest.mark.parametrize("case", FRAG_CASES, ids=[c[0] for c in FRAG_CASES])
def test_gpu_frag_forced_config(dev, case):
    """The fragment-layout kernel with forced tiles and splits (each twice: the split-K counters
    reset themselves), outputs poisoned, against float64."""
    _need(dev)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    from gemv_cases import TOL, forced_config

    w = weight(case)
    M, K, extra = case[5], case[7], case[9]
    x = (torch.randn(M, K, device=f"cuda:{dev.index}", dtype=torch.float64) * extra.get("xscale", 1.0)).to(torch.bfloat16)
    wd = w.with_tensors({k: torch.as_tensor(v).to(f"cuda:{dev.index}") for k, v in w.tensors.items()})
    op, _ = quant_gemv_op(x, wd)
    kern = Q.compile(op, dev, forced_config(extra["config"], num_warps=extra.get("num_warps", 4)))
    p = prepare_gemv_weight(w, dev)
    assert p.frag is not None
    ref = x.double().cpu().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T
    out = torch.empty((M, w.N), device=x.device, dtype=x.dtype)
    for _ in range(2):
        out.fill_(float("nan"))
        kern(x, p, out)
        assert next(iter(kern.launchers.values())).kind == "frag"
        err = np.abs(out.double().cpu().numpy() - ref).max() / (np.abs(ref).max() or 1)
        assert err <= TOL["bfloat16"] / 2, f"{case[0]}: {err:.3g}"


@gpu_param
def test_gpu_frag_refuses_other_activation_dtypes(dev):
    _need(dev)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig
    from portakern.errors import UnsupportedError
    from portakern.validate import quant_gemv_op

    case = FRAG_CASES[0]
    w = weight(case)
    x = torch.randn(4, case[7], device=f"cuda:{dev.index}", dtype=torch.float16)
    op, _ = quant_gemv_op(x, w.with_tensors({k: torch.as_tensor(v).to(x.device) for k, v in w.tensors.items()}))
    kern = Q.compile(op, dev, GemvConfig("frag", 64, 32, 2))
    with pytest.raises(UnsupportedError, match="dtype=float16"):
        kern(x, prepare_gemv_weight(w, dev), torch.empty((4, w.N), device=x.device, dtype=x.dtype))


@gpu_param
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_cuda_graph_replay_with_new_inputs(dev, split):
    """Capture the compiled kernel (split-K included) in a graph; replays see new x and write every output."""
    _need(dev)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig
    from portakern.validate import quant_gemv_op

    case = ("g", "native", 4, 128, False, 1, 4096, 4096, "bfloat16", {})
    w = weight(case)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    op, _ = quant_gemv_op(x, w.with_tensors({k: torch.as_tensor(v).cuda() for k, v in w.tensors.items()}))
    kern = Q.compile(op, dev, GemvConfig("fma", 32, 64, 4, 1, split, 2))
    p = prepare_gemv_weight(w, dev)
    out = torch.full((1, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
    kern(x, p, out)  # first call builds the launcher (and workspace)
    check_graph_replays(kern, x, p, out, w, 1e-2)


@gpu_param
@pytest.mark.parametrize("kind", ["fma-split1", "fma-split4", "fma-ahead2-split4", "dot-swap", "frag-split2",
                                  "frag-m16-split4"])
def test_gpu_pdl_chain_in_a_graph(dev, kind):
    """pdl=True launches read the previous kernel's output: a chain y1 = W1 x, y2 = W2 y1, y3 = W1 y2
    (split-K reusing one workspace back to back) captured in a CUDA graph, replayed with new x, every
    output poisoned before each replay, against float64; then eagerly without the graph."""
    _need(dev)
    if dev.capability < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+ (the refusal is tested above)")
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    M = {"dot-swap": 16, "frag-split2": 4, "frag-m16-split4": 16}.get(kind, 1)
    cfg = {"fma-split1": GemvConfig("fma", 32, 64, 4, 1, 1, 3, pdl=True),
           "fma-split4": GemvConfig("fma", 32, 64, 4, 1, 4, 3, pdl=True),
           "fma-ahead2-split4": GemvConfig("fma", 32, 64, 8, 1, 4, 3, prefetch=2, pdl=True),
           "dot-swap": GemvConfig("dot", 128, 32, 4, 2, 2, 2, swap_ab=True, pdl=True),
           "frag-split2": GemvConfig("frag", 64, 32, 2, split_k=2, pdl=True),
           "frag-m16-split4": GemvConfig("frag", 128, 32, 4, split_k=4, pdl=True)}[kind]
    n = 2048
    ws = [weight(("c", "native", 4, 128, False, M, n, n, "bfloat16", {}), seed=s) for s in (1, 2)]
    x = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
    op, _ = quant_gemv_op(x, ws[0].with_tensors({k: torch.as_tensor(v).cuda() for k, v in ws[0].tensors.items()}))
    kern = Q.compile(op, dev, cfg)
    ps = [prepare_gemv_weight(w, dev) for w in ws]
    ys = [torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def chain():
        kern(x, ps[0], ys[0])
        kern(ys[0], ps[1], ys[1])
        kern(ys[1], ps[0], ys[2])

    chain()   # builds the launcher
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    deq = [torch.from_numpy(dequantize(w.fmt, w.tensors, w.N, w.K)).double() for w in ws]

    def check(tag):
        # each stage's reference starts from the previous stage's device output (rounded to bf16 there)
        for i, (inp, w) in enumerate(((x, 0), (ys[0], 1), (ys[1], 0))):
            ref = inp.double().cpu() @ deq[w].T
            err = ((ys[i].double().cpu() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, f"{tag}: stage {i} err {err:.3g}"

    for r in range(3):
        x.copy_(torch.randn_like(x))
        for y in ys:
            y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(f"replay {r}")
    for y in ys:
        y.fill_(float("nan"))
    chain()
    torch.cuda.synchronize()
    check("eager")


@gpu_param
def test_gpu_graph_with_attention_and_gemv_through_the_api(dev):
    """portakern.quant_gemv (and attention where triton supports it) captured in one graph."""
    _need(dev)
    import portakern
    from portakern.ir.packing import dequantize

    case = ("g", "native", 4, 128, False, 1, 1024, 2048, "bfloat16", {})
    w = weight(case)
    wd = w.with_tensors({k: torch.as_tensor(v).cuda() for k, v in w.tensors.items()})
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    try:
        portakern.attention(q, k, v, backend="triton")
        with_attention = True
    except portakern.UnsupportedError:
        with_attention = False
    portakern.quant_gemv(x, wd, backend="triton")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        portakern.quant_gemv(x, wd, backend="triton")
        if with_attention:
            portakern.attention(q, k, v, backend="triton")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = portakern.quant_gemv(x, wd, backend="triton")
        o = portakern.attention(q, k, v, backend="triton") if with_attention else None
    deq = dequantize(w.fmt, w.tensors, w.N, w.K)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        q.copy_(torch.randn_like(q))
        g.replay()
        ref = x.double().cpu().numpy() @ deq.T
        assert np.abs(y.double().cpu().numpy() - ref).max() / np.abs(ref).max() < 1e-2
        if with_attention:
            ref_o = portakern.attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), backend="cpu")
            assert (o.float().cpu() - ref_o).abs().max().item() < 3e-2


@pytest.fixture()
def guard_log(monkeypatch):
    """Every KernelLaunch guard's verdict, in call order (True: the launch bypassed Triton's binding)."""
    from portakern.backends.triton.common.launch import KernelLaunch

    log, guard = [], KernelLaunch._guard

    def logged(self, fast, args):
        ok = guard(self, fast, args)
        log.append(ok)
        return ok

    monkeypatch.setattr(KernelLaunch, "_guard", logged)
    return log


@gpu_param
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (1, 14336, 4096), (16, 4096, 4096)],
                         ids=["m1-fma-split", "m1-stream", "m16-tensor-core"])
def test_gpu_fast_launch_values(dev, guard_log, M, N, K):
    """The table's kernel called again on new tensors: the later launches go straight through the compiled
    launcher and still compute the new values (outputs poisoned); an x 2 bytes off 16-byte alignment takes
    Triton's path (a kernel compiled without the alignment assumption) and is right too."""
    _need(dev)
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    case = ("g", "native", 4, 128, False, M, N, K, "bfloat16", {})
    w = weight(case)
    cuda = f"cuda:{dev.index}"
    op, _ = quant_gemv_op(torch.empty(M, K, dtype=torch.bfloat16), w)
    kern, p = Q.compile(op, dev), prepare_gemv_weight(w, dev)
    wref = dequantize(w.fmt, w.tensors, w.N, w.K)
    verdicts = []
    for call, offset in enumerate([0, 0, 0, 1, 0, 0]):
        buf = torch.randn(M * K + offset, device=cuda).to(torch.bfloat16)
        x = buf[offset:].view(M, K)
        out = torch.full((M, N), float("nan"), device=cuda, dtype=torch.bfloat16)
        n = len(guard_log)
        kern(x, p, out)
        verdicts.append(guard_log[n:])
        ref = x.double().cpu().numpy() @ wref.T
        err = np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert err <= 1e-2, f"call {call} (x offset {offset}): {err:.3g}"
    # call 0 compiles (no guard yet); 1 and 2 are fast; the misaligned 3 is not, and its kernel (compiled without
    # the alignment assumption) is not kept; 4 binds anew through Triton (no guard); 5 is fast again
    assert verdicts == [[], [True], [True], [False], [], [True]], verdicts
