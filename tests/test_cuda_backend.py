"""The cuda backend (``backends/cuda``: CUDA C compiled by NVRTC) off the GPU: what it accepts and why it refuses,
its launch rule, its ``-D`` constants per format, its lowering for every target (NVRTC from the package index: no
GPU, no toolkit), the prepared weight it shares with the triton backend, and the kernel's own CUDA C run on the
CPU (``host_run``) against float64. Its values on the hardware: the GPU tests at the end (skipped without a CUDA
device) and conformance on a GPU.

Without cuda-bindings / NVRTC or a host C++ compiler these tests skip on a developer's machine but fail under ``CI``
(scripts/setup.sh installs ``portakern[cuda]``; the machine has g++), so CI cannot go green by skipping them."""

from __future__ import annotations


import numpy as np
import pytest

import portakern
from portakern.devices import Device
from portakern.ir import DType, Packing, QuantFormat
from portakern.ir.ops import QuantGemv

from cuda_helpers import H200, C, gemv, require_cxx, require_nvrtc  # noqa: F401 (C: a fixture)


@pytest.fixture
def backend():
    require_nvrtc()
    return next(b for b in portakern.list_backends() if b.name == "cuda")


def test_registered_and_ranked_below_triton(backend):
    triton = next(b for b in portakern.list_backends() if b.name == "triton")
    assert backend.status() == "ok"
    assert backend.priority < triton.priority          # not yet measured on a GPU: serves when named or measured
    assert backend.weight_layout == triton.weight_layout == "gemv-tiled" and "sm_90a" in backend.compile_targets


@pytest.mark.parametrize("op,why", [
    (gemv(M=5), "M = 1 to 4 rows"),
    (gemv(gs=32), "groups of 128"),
    (gemv(bits=4, has_g_idx=True, packing=Packing.GPTQ), "g_idx"),
    (gemv(K=4160), "K must be a multiple of 128"),
    (gemv(dtype=DType.float32), "float16 or bfloat16 activations"),
    (gemv(scale_dtype=DType.float32), "scales must be float16 or bfloat16"),
    (gemv(N=2048, K=4096, prologue="silu_mul"), "prologue='silu_mul'"),
    (gemv(K=128 * 1031), "no K split"),                # 1031 groups (prime): one slice of x, 580 KB
])
def test_refusals_say_why(backend, op, why):
    s = backend.supports(op, H200)
    assert not s.ok and why in s.reason


def test_refuses_other_devices_and_old_gpus(backend):
    assert "not on cpu devices" in backend.supports(gemv(), Device("cpu", None, arch="x86_64", name="cpu")).reason
    old = Device("cuda", 0, arch="sm_75", name="T4", capability=(7, 5), warp_size=32)
    assert "sm_80 or newer" in backend.supports(gemv(), old).reason
    from portakern.ir.ops import Attention

    attn = Attention(batch=1, seqlen_q=1, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=8, head_dim_v=8,
                     dtype=DType.float16, scale=1.0)
    assert "head_dim must equal head_dim_v and be one of 32, 64, 96, 128, 256" in backend.supports(attn, H200).reason


@pytest.mark.parametrize("M,N,K,bits", [(1, 4096, 4096, 4), (1, 4096, 14336, 4), (1, 28672, 8192, 4),
                                        (1, 128256, 4096, 4), (1, 8192, 8192, 8), (1, 1000, 4096, 4), (1, 64, 128, 4),
                                        (1, 4096, 65536, 4), (4, 4096, 14336, 4), (3, 8192, 8192, 8)])
def test_launch_rule_holds_whole_groups_and_fits(C, M, N, K, bits):
    op = gemv(M=M, N=N, K=K, bits=bits)
    cfg = C.choose(op, 132)
    groups = K // 128
    assert groups % cfg.splits == 0 and 1 <= cfg.pf <= groups // cfg.splits
    assert C.smem_bytes(op, cfg) <= C.SMEM_PER_CTA
    tiles = -(-N // cfg.columns)
    fitting = [s for s in C.SPLITS if groups % s == 0 and
               C.smem_bytes(op, C.SmallMConfig(cfg.quads, cfg.lanes, s)) <= C.SMEM_PER_CTA]
    if any(tiles * s >= 264 for s in fitting):          # two CTAs per multiprocessor when a split allows it ...
        assert tiles * cfg.splits >= 264
        assert all(tiles * s < 264 for s in fitting if s < cfg.splits)   # ... with the fewest slices
    else:
        assert cfg.splits == fitting[-1]


def test_defines_follow_the_format(C):
    cfg = C.SmallMConfig()
    d = C.defines(gemv(N=1000, dtype=DType.float16, out_dtype=DType.float32, scale_dtype=DType.bfloat16), cfg,
                  True, None)
    assert (d["N"], d["NP"], d["X_F16"], d["S_BF16"], d["OUT_KIND"], d["HAS_Z"], d["PDL"]) == (1000, 1024, 1, 1, 2,
                                                                                               1, 1)
    d = C.defines(gemv(bits=8, sym=True), cfg, False, 128)
    assert (d["BITS"], d["HAS_Z"], d["ZP"], d["X_F16"], d["OUT_KIND"], d["PDL"]) == (8, 0, 128, 0, 0, 0)


@pytest.mark.parametrize("target", ["sm_80", "sm_90a", "sm_100a", "sm_120"])
@pytest.mark.parametrize("op", [gemv(), gemv(N=4096, K=14336), gemv(bits=8, N=8192, K=8192),
                                gemv(sym=True, dtype=DType.float16, scale_dtype=DType.bfloat16),
                                gemv(N=1000, K=1024, out_dtype=DType.float32), gemv(M=4),
                                gemv(M=3, bits=8, N=8192, K=8192), gemv(M=2, N=4096, K=14336, dtype=DType.float16)])
def test_lowers_for_every_target_without_spilling_its_state(backend, target, op):
    art = backend.compile_for_target(op, target)
    assert art["cubin_bytes"] > 1000 and art["registers"] and art["registers"] <= 255
    # at most a register or two (MAX_SPILL_BYTES); None only where NVRTC answered from a GPU machine's compute cache
    assert art["spill_bytes"] is None or art["spill_bytes"] <= 16
    assert art["frame_bytes"] <= 8                    # MAX_SPILL_FRAME_BYTES
    assert art["smem_bytes"] <= 48 * 1024


#: a kernel that always keeps a stack frame, whatever NVRTC's version (a local array indexed by a run-time value):
#: whether a gemv configuration spills depends on the ptxas inside NVRTC (the spilling configuration on NVRTC 13.5
#: keeps no frame on the GPU machine's), so the frame side of the cubin reader is checked on this one
FRAME_KERNEL = """
extern "C" __global__ void portakern_frame(const int* in, int* out) {
    int a[256];
    for (int i = 0; i < 256; ++i) a[(i * 7 + in[i]) & 255] = in[i * blockDim.x + threadIdx.x];
    out[threadIdx.x] = a[in[threadIdx.x] & 255];
}
"""


def test_the_cubin_records_what_ptxas_reports(C):
    # registers and stack frame read from the cubin's .nv.info (what a compute-cache hit leaves) equal ptxas' own
    # report of a fresh compile, on every target, for gemv kernels and for a kernel that keeps a stack frame
    import re
    import uuid

    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda.common.cubin_info import cubin_resources

    # code no earlier compile produced (a device global named by a fresh uuid: a comment would not do, since the
    # preprocessor drops it before the compute cache is asked), so on a GPU machine NVRTC cannot answer from the
    # driver's compute cache and ptxas runs
    nonce = lambda: f"\n__device__ int portakern_nonce_{uuid.uuid4().hex};\n"     # noqa: E731
    gemvs = [(gemv(), C.SmallMConfig(32, 4, 8, 2, 0)), (gemv(M=4), C.SmallMConfig(32, 4, 8, 2, 0)),
             (gemv(N=8192, K=8192), C.SmallMConfig(16, 8, 16, 1, 0))]
    compiles = [(nvrtc.source(C.SOURCE), lambda t, op=op, cfg=cfg: tuple(C.defines(op, cfg, t != "sm_80", None).items()))
                for op, cfg in gemvs] + [(FRAME_KERNEL, lambda t: ())]
    frames = []
    for text, defines in compiles:
        for target in C.TARGETS.values():
            c = nvrtc.compile_text(text + nonce(), C.SOURCE, defines(target), target)
            assert c.ptxas_ran, c.log
            res = cubin_resources(c.cubin)
            assert res["registers"] == int(re.search(r"Used (\d+) registers", c.log).group(1))
            assert res["frame_bytes"] == int(re.search(r"(\d+) bytes stack frame", c.log).group(1))
            frames.append(res["frame_bytes"])
    assert min(frames) == 0 and frames[-len(C.TARGETS):] == [1024] * len(C.TARGETS)   # the frame kernel's 256 ints


def test_a_compute_cache_hit_is_judged_by_its_cubin(C, monkeypatch):
    # on a GPU machine NVRTC may return a cached cubin with no ptxas report: registers come from the cubin, the spill
    # traffic is unknown (None), and compile_for_target judges the spill by the cubin's stack frame against
    # MAX_SPILL_FRAME_BYTES
    import dataclasses

    from portakern.backends.cuda.common import nvrtc
    from portakern.errors import BackendError

    fresh = {}

    def cached(name, defines, target):
        c = nvrtc.compile_text(nvrtc.source(name), name, defines, target)
        fresh[name, target] = c
        return dataclasses.replace(c, log="")

    monkeypatch.setattr(nvrtc, "compile_source", cached)
    art = C.compile_for_target(gemv(), "sm_90a")
    assert (art["registers"], art["spill_bytes"], art["frame_bytes"]) == (fresh[C.SOURCE, "sm_90a"].registers, None, 0)
    frag = art["frag"]                                  # an int4 op: the fragment kernel is lowered and judged too
    assert (frag["registers"], frag["spill_bytes"]) == (fresh[C.FRAG_SOURCE, "sm_90a"].registers, None)
    spilling = C.SmallMConfig(16, 8, 16, 1, 0)   # keeps 8 bytes of frame on NVRTC 13.5, none on some other versions
    frame = C.compile_for_target(gemv(N=8192, K=8192), "sm_90a", spilling)["frame_bytes"]
    assert frame == fresh[C.SOURCE, "sm_90a"].frame_bytes <= C.MAX_SPILL_FRAME_BYTES               # within the bound
    monkeypatch.setattr(C, "MAX_SPILL_FRAME_BYTES", frame - 1)                         # one byte under it
    with pytest.raises(BackendError, match=rf"spills \(None bytes of spill traffic, {frame} bytes of stack frame\)"):
        C.compile_for_target(gemv(N=8192, K=8192), "sm_90a", spilling)


def test_cubin_resources_refuses_what_is_not_a_cubin():
    from portakern.backends.cuda.common.cubin_info import cubin_resources

    with pytest.raises(ValueError, match="not a little-endian ELF64 cubin"):
        cubin_resources(b"\x7fELF\x01\x01" + bytes(64))


def test_cubin_resources_refuses_an_attribute_it_cannot_read(C):
    # a real cubin whose .nv.info begins with an attribute format no cubin uses
    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda.common.cubin_info import _sections, cubin_resources

    cubin = nvrtc.compile_source(C.SOURCE, tuple(C.defines(gemv(), C.SmallMConfig(), True, None).items()),
                                 "sm_90a").cubin
    at = cubin.index(_sections(cubin)[".nv.info"])
    broken = cubin[:at] + b"\x07" + cubin[at + 1:]
    with pytest.raises(ValueError, match=r"\.nv\.info: unknown attribute format 0x7 at byte 0"):
        cubin_resources(broken)


def test_a_rejected_source_raises_with_the_log(C):
    from portakern.backends.cuda.common import nvrtc
    from portakern.errors import BackendError

    bad = dict(C.defines(gemv(), C.SmallMConfig(lanes=3), True, None))    # 3 row lanes do not divide a group
    with pytest.raises(BackendError, match="row lanes must divide"):
        nvrtc.compile_source(C.SOURCE, tuple(bad.items()), "sm_90a")


def test_the_prepared_weight_is_shared_by_layout(register_plugin, rng):
    # a backend that names another's layout reuses that backend's prepared copy instead of making its own
    from plugin_helpers import provides

    from portakern.backends.cpu.backend import CpuBackend

    class SharesCpu(CpuBackend):
        name, priority, weight_layout = "shares-cpu", 10, "cpu"

        def prepare_weight(self, weight, device):
            raise AssertionError("must reuse the cpu backend's prepared weight")

    register_plugin(provides(SharesCpu()), name="shares")
    w = portakern.quantize(rng.standard_normal((16, 256)).astype(np.float32), bits=4, group_size=128)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ref = portakern.quant_gemv(x, w, backend="cpu")
    assert list(w.prepared) == [("cpu", "cpu")]
    np.testing.assert_array_equal(portakern.quant_gemv(x, w, backend="shares-cpu"), ref)
    assert list(w.prepared) == [("cpu", "cpu")]


# -- the kernel's own CUDA C, run on the CPU (host_run: threads of a block as std::threads) -------------------

@pytest.mark.parametrize("M,N,K,bits,sym,xdt,sdt,odt,cfg", [
    (1, 256, 1024, 4, False, "bfloat16", "float16", "float32", (16, 4, 1, 2)),    # one slice, the PF ring refilled
    (1, 1000, 1024, 4, False, "float16", "bfloat16", "float32", (16, 4, 2, 2)),   # N past the last full tile, masked
    (1, 256, 1152, 4, False, "bfloat16", "float16", "float32", (32, 2, 1, 2)),    # 9 groups: the ring ends mid-pair
    (1, 300, 1536, 4, True, "bfloat16", "bfloat16", "float32", (32, 4, 4, 1)),    # symmetric: the constant zero point
    (1, 200, 2048, 8, True, "bfloat16", "float16", "float32", (16, 8, 4, 2)),
    (1, 200, 2048, 8, False, "float16", "float16", "float32", (16, 16, 2, 1)),
    (1, 256, 4096, 4, False, "bfloat16", "float16", "float32", (16, 8, 32, 1)),   # 32 slices of one group each
    (2, 1000, 1024, 4, False, "bfloat16", "float16", "float32", (16, 4, 2, 2)),   # rows of x: staged, merged apart
    (3, 256, 1152, 4, True, "float16", "bfloat16", "float32", (32, 4, 3, 1)),
    (4, 200, 2048, 8, False, "bfloat16", "float16", "float32", (16, 8, 4, 2)),
    (1, 1000, 1024, 4, False, "bfloat16", "float16", "float32", (16, 4, 2, 4)),   # the slice's every group in flight
    (1, 256, 1536, 4, False, "float16", "float16", "float32", (16, 4, 1, 8)),     # 12 groups, PF 8: one partial refill
])
def test_kernel_source_on_the_host_matches_float64(M, N, K, bits, sym, xdt, sdt, odt, cfg):
    require_cxx()
    out, ref = _host_gemv(N, K, bits, sym, xdt, sdt, odt, cfg, M)
    assert out.shape == (M, N) and np.isfinite(out).all()
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-6       # fp32 accumulation, fp32 out


@pytest.mark.parametrize("odt,tol", [("bfloat16", 2 ** -8), ("float16", 2 ** -11)])
def test_kernel_rounds_its_output_to_the_dtype(odt, tol):
    require_cxx()
    out, ref = _host_gemv(512, 1024, 4, False, "bfloat16", "float16", odt, (16, 4, 4, 2))
    rel = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-3)
    assert np.isfinite(out).all() and np.median(rel) < tol and np.abs(out - ref).max() / np.abs(ref).max() < 8 * tol


@pytest.mark.parametrize("odt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bits,sym,splits", [(4, False, 1), (4, False, 4), (8, True, 2)])
def test_a_nan_in_x_reaches_every_output_of_its_row_in_every_output_dtype(odt, bits, sym, splits):
    # bf16 output rounds by adding 0x7FFF to the float's bits: without the NaN branch, the NaN CUDA's arithmetic
    # makes (0x7FFFFFFF) carries over into -0.0 (the GPU conformance case nf-xnan-gemv-native4a found it)
    require_cxx()
    out, _ = _host_gemv(256, 1024, bits, sym, "float16", "float16", odt, (16, 4, splits, 2), M=2, x_nan=(0, 300))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_host_run_sees_a_broken_lane_map(monkeypatch):
    # the same kernel with each thread's rows taken one lane off: the host run must not pass it
    require_cxx()
    from portakern.backends.cuda.common import host_run

    src = (host_run._KERNELS / "gemv_small_m.cu").read_text()
    bad = src.replace("const u32 j = g * GROUP_ROWS + lane + LANES * m;",
                      "const u32 j = g * GROUP_ROWS + (lane + 1) % LANES + LANES * m;")
    assert bad != src
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    for f in ("host_shim.h", "host_launch.cpp"):
        (d / f).write_text((host_run._KERNELS / f).read_text())
    (d / "gemv_small_m.cu").write_text(bad)
    monkeypatch.setattr(host_run, "_KERNELS", d)
    host_run.build.cache_clear()
    try:
        out, ref = _host_gemv(256, 1024, 4, False, "bfloat16", "float16", "float32", (16, 4, 1, 2))
    finally:
        host_run.build.cache_clear()
    assert np.abs(out - ref).max() / np.abs(ref).max() > 1e-2


def _host_gemv(N, K, bits, sym, xdt, sdt, odt, cfg, M=1, x_nan=None):
    torch = pytest.importorskip("torch")
    from portakern.backends.cuda import quant_gemv as C
    from portakern.backends.cuda.common.host_run import quant_gemv_on_host
    from portakern.gemv_weight import prepare_gemv_weight

    g = torch.Generator().manual_seed(N * 7 + K + bits)
    w = portakern.quantize(torch.randn(N, K, generator=g).numpy(), bits=bits, group_size=128, symmetric=sym,
                           scale_dtype=sdt)
    x = torch.randn(M, K, generator=g).to(getattr(torch, xdt))
    if x_nan is not None:   # a NaN of every mantissa bit set: fp16 0x7FFF widens to 0x7FFFE000, like the GPU's 0x7FFFFFFF
        x.view(torch.int16)[x_nan] = 0x7FFF
    op = QuantGemv(M=M, N=N, K=K, dtype=DType(xdt), fmt=w.fmt, out_dtype=DType(odt))
    cpu = Device("cpu", None, arch="x86_64", name="cpu")
    out = quant_gemv_on_host(op, prepare_gemv_weight(w, cpu), x, C.SmallMConfig(*cfg))
    return out, _float64(x, w)


# -- on a GPU ------------------------------------------------------------------------------------------

def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    require_nvrtc()
    return torch


def _float64(x, w):
    """float64 ``x @ dequant(W)^T``, the weight unpacked by its format's own reader (``ir.packing.unpack``)."""
    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    host = {k: np.asarray(to_numpy(v)) for k, v in w.tensors.items()}
    codes, scales, zeros, group = unpack(w.fmt, host, w.N, w.K)
    W = (codes - zeros[:, group]) * scales[:, group]
    return x.double().cpu().numpy() @ W.T


@pytest.mark.parametrize("M,N,K,bits,sym,dtype,sdt", [
    (1, 4096, 4096, 4, False, "bfloat16", "float16"), (1, 1000, 4096, 4, True, "float16", "float16"),
    (1, 4096, 14336, 4, False, "bfloat16", "bfloat16"), (1, 8192, 8192, 8, False, "bfloat16", "float16"),
    (1, 3000, 1024, 8, True, "float16", "bfloat16"), (1, 28672, 4096, 4, False, "float16", "float16"),
    (4, 4096, 14336, 4, False, "bfloat16", "float16"), (3, 8192, 8192, 8, True, "float16", "float16"),
])
def test_gpu_values_against_float64(M, N, K, bits, sym, dtype, sdt):
    torch = _cuda()
    g = torch.Generator().manual_seed(N + K + bits)
    wf = torch.randn(N, K, generator=g)
    w = portakern.quantize(wf.numpy(), bits=bits, group_size=128, symmetric=sym, scale_dtype=sdt)
    w = w.to("cuda")
    x = torch.randn(M, K, generator=g).to(getattr(torch, dtype)).cuda()
    ref = _float64(x, w)
    for _ in range(2):
        out = portakern.quant_gemv(x, w, backend="cuda")
        err = (out.double().cpu().numpy() - ref).__abs__().max() / np.abs(ref).max()
        assert err < 1e-2, err


def test_gpu_graph_replays_with_new_inputs():
    torch = _cuda()
    N, K = 4096, 4096
    g = torch.Generator().manual_seed(0)
    w = portakern.quantize(torch.randn(N, K, generator=g).numpy(), bits=4, group_size=128).to("cuda")
    x = torch.randn(1, K, generator=g).to(torch.bfloat16).cuda()
    portakern.quant_gemv(x, w, backend="cuda")                     # first call: compile, workspace
    with portakern.use_backend("cuda"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            portakern.quant_gemv(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = portakern.quant_gemv(x, w)
    for seed in (1, 2):
        x.copy_(torch.randn(1, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _float64(x, w)
        assert np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max() < 1e-2


def test_attention_it_has_no_kernel_for_is_refused_with_the_way_out_and_never_compiled(backend):
    # what the CuTe DSL attention serves, and its lowering: tests/test_cuda_cute_attention.py
    from portakern.ir.ops import Attention

    attn = Attention(batch=1, seqlen_q=1, seqlen_k=8, heads_q=1, heads_kv=1, head_dim=8, head_dim_v=8,
                     dtype=DType.float16, scale=1.0)
    why = backend.supports(attn, H200).reason
    assert "one of 32, 64, 96, 128, 256" in why and "backend='triton'" in why
    with pytest.raises(NotImplementedError, match="one of 32, 64, 96, 128, 256"):
        backend.compile(attn, H200)
    with pytest.raises(NotImplementedError, match="one of 32, 64, 96, 128, 256"):
        backend.compile_for_target(attn, "sm_90a")


def test_write_table_from_a_sweep(tmp_path, monkeypatch):
    import json
    import sys
    from pathlib import Path

    from portakern.backends.cuda import tuning

    monkeypatch.setattr(tuning, "TABLE", {})       # the writer merges into the committed entries
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gemv_table_sweep as gemv_wide

    res = {"capability": [9, 0], "gpu": "NVIDIA H200", "bench": [
        {"M": 1, "bits": 4, "N": 4096, "K": 4096, "best": "32,4,8,2,0", "best_us": 4.0, "table_us": 6.3},
        {"M": 4, "bits": 4, "N": 8192, "K": 8192, "best": "16,8,4,1,1", "best_us": 20.0, "table_us": 20.1}]}
    (tmp_path / "bench.json").write_text(json.dumps(res))

    def written(**kw):
        out = gemv_wide.write_table([str(tmp_path / "bench.json")], out=str(tmp_path / "gemv_table.py"), **kw)
        ns: dict = {}
        exec(Path(out).read_text(), ns)
        return ns["TABLE"]

    E = tuning.GemvEntry                               # each entry names the sweep file that measured it
    assert written() == {("sm_90/h200", 1, 4, 4096, 4096): E(32, 4, 8, 2, 0, True, "bench.json"),  # the sweep's card
                         ("sm_90/h200", 4, 4, 8192, 8192): E(16, 8, 4, 1, 1, False, "bench.json")}  # 20.0: not 2% under
    assert written(scope="family") == {("sm_90", 1, 4, 4096, 4096): E(32, 4, 8, 2, 0, True, "bench.json"),
                                       ("sm_90", 4, 4, 8192, 8192): E(16, 8, 4, 1, 1, False, "bench.json")}
    assert all(type(e).__name__ == "GemvEntry" for e in written().values())
    with pytest.raises(ValueError, match="'card' or 'family'"):
        written(scope="gpu")
    (tmp_path / "bench.json").write_text(json.dumps({**res, "gpu": "Graphics Device"}))
    with pytest.raises(ValueError, match="no card in its GPU name 'Graphics Device'.*scope 'family'"):
        written()
    (tmp_path / "old.json").write_text(json.dumps({"bench": []}))
    with pytest.raises(ValueError, match="records no GPU capability"):
        gemv_wide.write_table([str(tmp_path / "old.json")], out=str(tmp_path / "x.py"))


def test_a_cards_own_entry_comes_before_its_familys(C, backend, monkeypatch):
    # measured on the H200 itself: the H200 takes that entry; an H100 (and an unnamed sm_90 card) keep the family's
    # (weights that hold words: the word kernel's table ranks)
    from portakern import gemv_weight
    from portakern.backends import cuda as plugin
    from portakern.backends.cuda import tuning

    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    op = gemv(N=4096, K=14336)
    h100 = Device("cuda", 0, arch="sm_90a", name="NVIDIA H100 80GB HBM3", capability=(9, 0), warp_size=32)
    other = Device("cuda", 0, arch="sm_90a", name="Graphics Device", capability=(9, 0), warp_size=32)
    entry = tuning.GemvEntry
    monkeypatch.setattr(tuning, "TABLE", {("sm_90", 1, 4, 4096, 14336): entry(32, 4, 14, 2, 1, False, "t"),  # not the
                                          ("sm_90/h200", 1, 4, 4096, 14336): entry(16, 8, 7, 1, 1, True, "t")})  # committed
    assert C.choose(op, 132, (9, 0), H200.name) == C.SmallMConfig(16, 8, 7, 1, 1)
    assert C.choose(op, 132, (9, 0), h100.name) == C.choose(op, 132, (9, 0)) == C.SmallMConfig(32, 4, 14, 2, 1)
    assert plugin.portakern_backend_priority(backend, op, H200) == plugin.MEASURED_WIN_PRIORITY
    assert plugin.portakern_backend_priority(backend, op, h100) is None
    assert plugin.portakern_backend_priority(backend, op, other) is None
    assert [C.card(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "NVIDIA L40S", "")] \
        == ["h200", "h100", "gh200", None, None]


# -- the host wrapper, with the launch recorded instead of run ----------------------------------------------

def test_wrapper_checks_and_launch_geometry_without_a_gpu(C, monkeypatch):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from portakern.backends.cuda.common import nvrtc
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.errors import InvalidInputError

    launches = []

    class Recorder:
        def __init__(self, compiled, entry, index, smem, pdl):
            self.entry, self.smem, self.pdl = entry, smem, pdl

        def __call__(self, grid, threads, *ptrs):
            launches.append((grid, threads, ptrs))

    monkeypatch.setattr(nvrtc, "Function", Recorder)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    N, K = 1000, 1024
    w = portakern.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(np.float32), bits=4,
                           group_size=128)
    cpu = Device("cpu", None, arch="x86_64", name="cpu")
    pw = prepare_gemv_weight(w, cpu)
    op = QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=w.fmt)
    cfg = C.SmallMConfig(16, 4, 1, 2)                    # one slice: no per-stream workspace (that needs CUDA)
    kern = C.compile(op, H200, cfg)
    assert kern.config == cfg
    x = torch.randn(1, K).to(torch.bfloat16)
    out = torch.empty(1, N, dtype=torch.bfloat16)
    kern(x, pw, out)
    grid, threads, ptrs = launches[-1]
    assert (grid, threads) == (-(-N // 64), 64)          # 16 tiles of 64 columns, the last one masked
    assert ptrs[:5] == (pw.qweight.data_ptr(), pw.scales.data_ptr(), pw.zeros.data_ptr(), x.data_ptr(),
                        out.data_ptr())
    strided = torch.randn(1, 2 * K).to(torch.bfloat16)[:, ::2]
    kern(strided, pw, out)                               # not contiguous: a contiguous copy is launched
    assert launches[-1][2][3] != strided.data_ptr()
    with pytest.raises(InvalidInputError, match="out has strides"):
        kern(x, pw, torch.empty(1, 2 * N, dtype=torch.bfloat16)[:, ::2])
    sym = prepare_gemv_weight(portakern.quantize(np.ones((N, K), np.float32), bits=4, group_size=128,
                                                 symmetric=True), cpu)
    with pytest.raises(InvalidInputError, match="lacks zero points"):
        kern(x, sym, out)
    other = prepare_gemv_weight(portakern.quantize(np.ones((1200, K), np.float32), bits=4, group_size=128), cpu)
    with pytest.raises(InvalidInputError, match="row stride is 1280, expected 1024"):
        kern(x, other, out)
    from dataclasses import replace

    sym_op = QuantGemv(M=1, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=True))
    sym_kern = C.compile(sym_op, H200, cfg)
    sym_kern(x, sym, out)                                # zero point 8 baked in, as the weight stores it
    with pytest.raises(InvalidInputError, match="zero point is 3, the op's format's 8"):
        sym_kern(x, replace(sym, zero_point=3), out)


def test_choose_and_host_run_say_what_they_cannot_do(C, monkeypatch):
    from portakern.backends.cuda.common import host_run
    from portakern.errors import BackendError, InvalidInputError

    with pytest.raises(InvalidInputError, match=r"quant_gemv\(K=131968\) on cuda: no K split .* use the triton backend"):
        C.choose(gemv(K=128 * 1031), 132)
    with pytest.raises(BackendError, match="every array must be C-contiguous"):
        host_run.run(None, 1, 1, 0, np.zeros((4, 4), np.float32)[:, ::2])
    monkeypatch.setattr(host_run, "compiler", lambda: None)
    host_run.build.cache_clear()
    try:
        with pytest.raises(BackendError, match="no host C\\+\\+ compiler"):
            host_run.build(C.SOURCE, C.ENTRY, (("M", 1),))
    finally:
        host_run.build.cache_clear()
