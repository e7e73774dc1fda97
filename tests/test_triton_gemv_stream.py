"""The stream-K int4 GEMV for M = 1 (kind "stream": ``backends/triton/quant_gemv/stream.py``, ``kernels/gemv_stream.py``).

Gluon kernels have no interpreter, so off the GPU these tests check which ops the kernel serves, the
table's choice, ``fit``, the staging of x, the refusal on the CPU and the lowering for sm_90a and sm_80;
on a CUDA device they run it against float64 on NaN-poisoned outputs, with grids whose programs share
column tiles in every way the kernel distinguishes, and replay it in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from gemv_cases import TOL, check_graph_replays, weight  # noqa: E402  (tests/ is on sys.path)
from triton_helpers import needs_compiler  # noqa: E402

from portakern.gemv_weight import prepare_gemv_weight  # noqa: E402
from portakern.ir import DType, Packing, QuantFormat  # noqa: E402
from portakern.ir.ops import QuantGemv  # noqa: E402


def _op(N=8192, K=8192, M=1, bits=4, G=128, packing="native", act=False, sym=False, dtype=DType.bfloat16):
    fmt = QuantFormat(bits=bits, group_size=G, symmetric=sym, packing=Packing(packing), has_g_idx=act)
    return QuantGemv(M=M, N=N, K=K, dtype=dtype, fmt=fmt)


def _lay(**kw):
    from portakern.backends.triton.quant_gemv import aot as QA

    return QA.LayoutStub(_op(**kw))


@needs_compiler
def test_sm90_table_takes_the_stream_kernel_for_int4_m1_from_6144_rows():
    from portakern.backends.triton.quant_gemv import config as T

    for N, K in ((6144, 4096), (8192, 8192), (28672, 8192), (16384, 16384), (128256, 4096)):
        for dt in ("bfloat16", "float16", "float32"):
            cfg = T.choose(_lay(N=N, K=K), 1, N, "sm_90", 132, dtype=dt)
            assert (cfg.kind, cfg.block_n, cfg.num_warps, cfg.prefetch, cfg.per_sm, cfg.pdl) == \
                ("stream", 256, 8, 1, 2, True), (N, K, dt, cfg)
    assert T.choose(_lay(N=4096, K=14336), 1, 4096, "sm_90", 132).kind == "fma"       # below STREAM_MIN_N
    for arch in ("sm_80", "sm_100", "sm_120", "interp"):                                # measured on sm_90 only
        assert T.choose(_lay(), 1, 8192, arch, 132).kind != "stream", arch
    for other, M in ((_lay(M=2), 2), (_lay(bits=8), 1), (_lay(packing="gptq", act=True), 1), (_lay(G=100, K=8000), 1)):
        assert T.choose(other, M, 8192, "sm_90", 132).kind != "stream"
    assert T.choose(_lay(), 1, 8192, "sm_90", 132, stream=False).kind == "fma"


@needs_compiler
@pytest.mark.parametrize("kw,M,match", [
    (dict(M=2), 2, r"M=2 \(the kernel serves one row of x\)"),
    (dict(bits=8), 1, r"bits=8 \(int4 only\)"),
    (dict(packing="gptq", act=True), 1, r"act-order"),
    (dict(G=100, K=8000), 1, r"group_size=100 with K=8000 \(needs groups of a multiple of 32 columns dividing K\)"),
    (dict(K=65536), 1, r"K=65536 \(x of every group takes \d+ bytes of shared memory, over \d+\)"),
], ids=["m2", "int8", "act-order", "group100", "long-k"])
def test_usable_names_what_the_kernel_does_not_serve(kw, M, match):
    from portakern.backends.triton.quant_gemv.stream import usable

    why = usable(_lay(**kw), M)
    assert why is not None and __import__("re").search(match, why), why


@needs_compiler
def test_fit_makes_a_stream_config_legal_and_refuses_other_weights():
    from dataclasses import replace

    from portakern.backends.triton.quant_gemv import config as T

    base = T.GemvConfig("stream", block_n=100, block_kw=1, num_warps=1, split_k=4, prefetch=2, per_sm=9, dq=0)
    c = T.fit(base, _lay(G=64, K=4096), 1)
    assert (c.block_n, c.num_warps, c.block_kw, c.split_k, c.prefetch, c.per_sm, c.dq) == (128, 4, 8, 1, 2, 4, 3)
    c = T.fit(replace(base, block_n=512, per_sm=0), _lay(), 1)
    assert (c.block_n, c.num_warps, c.block_kw, c.per_sm) == (256, 8, 16, 1)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='stream'\) cannot serve this weight: bits=8 \(int4 only\); "
                                         r"use kind='fma'"):
        T.fit(base, _lay(bits=8), 1)
    with pytest.raises(ValueError, match=r"prefetch is 1, or 2 for the CUDA-core kernels"):
        T.fit(replace(base, prefetch=3), _lay(), 1)
    assert T.fit(replace(base, l2_prefetch=4), _lay(), 1).l2_prefetch == 4
    with pytest.raises(ValueError, match=r"GemvConfig\(l2_prefetch=9\): the stream kernel prefetches 0 to 8 units "
                                         r"into the L2; use a value in that range"):
        T.fit(replace(base, l2_prefetch=9), _lay(), 1)
    with pytest.raises(ValueError, match=r"GemvConfig\(kind='fma', l2_prefetch=2\): l2_prefetch is an option of the "
                                         r"stream kernel; use kind='stream' or l2_prefetch=0"):
        T.fit(T.GemvConfig("fma", 256, 8, l2_prefetch=2), _lay(), 1)


@needs_compiler
def test_x_is_staged_per_unit_when_a_range_is_shorter_than_k():
    from portakern.backends.triton.quant_gemv.stream import x_slots

    assert x_slots(64, 112 * 64, 264) == (32, True)      # 28672x8192, 256 columns, 2 programs per SM: 28 units
    assert x_slots(112, 16 * 112, 264) == (8, True)      # 4096x14336: 7 units
    assert x_slots(32, 16 * 32, 7) == (32, False)        # ranges of 74 units: every group, slot = group
    assert x_slots(4, 1, 1) == (1, True)


@needs_compiler
def test_grids_hold_per_sm_programs_and_never_more_than_the_units():
    """Every program must own a unit (a tile's arrival count counts the programs whose ranges meet it):
    a grid of ``per_sm`` per SM, or a forced size, is capped at the units."""
    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv.stream import grid_programs

    cfg = T.fit(T.GemvConfig("stream", 256, 16, per_sm=2), _lay(), 1)
    assert grid_programs(_op(), _lay(), cfg, 132) == 264
    assert grid_programs(_op(N=40, K=512), _lay(N=40, K=512), cfg, 132) == 4          # 1 tile x 4 groups
    assert grid_programs(_op(N=40, K=512), _lay(N=40, K=512), cfg, 132, programs=1000) == 4
    assert grid_programs(_op(), _lay(), cfg, 132, programs=7) == 7


@needs_compiler
@pytest.mark.parametrize("kind", ["stream", "frag"])
def test_a_forced_gluon_config_is_refused_on_the_cpu_with_the_way_out(kind):
    """Both Gluon kinds ("stream", and "frag" for M > 1) are refused before anything is built on the CPU."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig
    from portakern.devices import CPU
    from portakern.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=rf"GemvConfig\(kind='{kind}'\) is a Gluon kernel, which Triton's "
                                               r"interpreter cannot run; .* use kind='fma' or 'dot' here"):
        Q.compile(_op(N=64, K=512, M=1 if kind == "stream" else 4), CPU, GemvConfig(kind, 256, 16))


@needs_compiler
@pytest.mark.parametrize("target", ["sm_90a", "sm_80"])
def test_lowering_loads_16_bytes_per_row_and_waits_for_the_previous_kernel_on_sm90(target):
    """The table's choice (sm_90a) and a forced config (sm_80) lower to the stream kernel: 8 warps, 16-byte
    word loads, the scalar arrival counter, ``griddepcontrol`` where the config has pdl."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig

    op = _op(N=28672, K=8192)
    art = Q.compile_for_target(op, target, None if target == "sm_90a" else GemvConfig("stream", 256, 16))
    assert art["config"]["kind"] == "stream" and list(art["kernels"]) == ["gemv_stream_kernel"]
    k = art["kernels"]["gemv_stream_kernel"]
    ptx = k["ptx"]
    assert k["num_warps"] == 8 and ".reqntid 256" in ptx and k["cubin"]
    assert "ld.global.v4.b32" in ptx and "atom.global.gpu.acq_rel.add" in ptx
    assert ("griddepcontrol.wait" in ptx) == (target == "sm_90a")
    assert k["shared"] <= 99 * 1024
    assert "prefetch.global.L2" not in ptx                     # l2_prefetch: in no table


@needs_compiler
@pytest.mark.parametrize("units", [1, 3])
def test_lowering_with_l2_prefetch_asks_for_each_line_once_before_the_wait(units):
    """``l2_prefetch``: the next units' 128-byte lines (16 rows x 8 lines per 256-column unit), spread over the
    256 threads (padded to a power of two, at least one per thread: none twice), are prefetched into the L2
    before ``griddepcontrol.wait``."""
    from dataclasses import replace

    from portakern.backends.triton import quant_gemv as Q
    from portakern.backends.triton.quant_gemv.config import GemvConfig

    op = _op(N=28672, K=8192)
    cfg = GemvConfig(**Q.compile_for_target(op, "sm_90a")["config"])
    ptx = Q.compile_for_target(op, "sm_90a", replace(cfg, l2_prefetch=units))["kernels"]["gemv_stream_kernel"]["ptx"]
    lines = units * 16 * 8
    per_thread = max(1, (1 << (lines - 1).bit_length()) // 256)
    assert ptx.count("prefetch.global.L2") == per_thread
    assert ptx.rindex("prefetch.global.L2") < ptx.index("griddepcontrol.wait")


# -- on a CUDA device -------------------------------------------------------------------------------------

def _gpu():
    from portakern.devices import detect_devices

    devs = [d for d in detect_devices() if d.type == "cuda"]
    if not devs:
        pytest.skip("no CUDA device on this machine: the lowering tests above cover the kernel off the GPU")
    return devs[0]


#: (id, packing, group, symmetric, N, K, x dtype)
GPU_CASES = [
    ("native-asym-g128-bf16", "native", 128, False, 40, 512, "bfloat16"),
    ("native-sym-g128-f16", "native", 128, True, 300, 1024, "float16"),
    ("native-asym-g64-f32", "native", 64, False, 520, 2048, "float32"),
    ("awq-g128-bf16", "awq", 128, False, 520, 2048, "bfloat16"),
    ("gptq-g128-f16", "gptq", 128, False, 256, 4096, "float16"),
    ("gguf-q4_0-g32-bf16", "gguf_q4_0", 32, True, 264, 1024, "bfloat16"),
    ("native-asym-g128-bf16-4096", "native", 128, False, 4096, 4096, "bfloat16"),
]


@needs_compiler
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_float64_for_every_way_programs_share_tiles(case):
    """Grids of 1 program (one range over every tile), 7 and 1000 (tiles shared by programs whose ranges
    start and end inside them), the table's; each launched twice (the arrival counters reset
    themselves), outputs poisoned, against float64."""
    dev = _gpu()
    from portakern.backends.triton.quant_gemv import config as T
    from portakern.backends.triton.quant_gemv.stream import Launcher
    from portakern.ir.packing import dequantize
    from portakern.validate import quant_gemv_op

    cid, packing, G, sym, N, K, dt = case
    w = weight((cid, packing, 4, G, sym, 1, N, K, dt, {}))
    x = torch.randn(1, K, device=f"cuda:{dev.index}", dtype=torch.float64).to(getattr(torch, dt))
    op, _ = quant_gemv_op(x, w.with_tensors({k: torch.as_tensor(v).to(x.device) for k, v in w.tensors.items()}))
    p = prepare_gemv_weight(w, dev)
    ref = x.double().cpu().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T
    for bn, ahead, l2 in ((256, 1, 0), (128, 2, 0), (256, 1, 3)):
        cfg = T.fit(T.GemvConfig("stream", bn, 16, prefetch=ahead, pdl=True, l2_prefetch=l2), p, 1)
        for programs in (1, 7, 1000, None):
            ln = Launcher(op, p, cfg, 132, str(x.device), programs=programs)
            out = torch.empty((1, N), device=x.device, dtype=x.dtype)
            for _ in range(2):
                out.fill_(float("nan"))
                ln(x, p, out)
                err = np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max()
                assert err <= TOL[dt], (cid, bn, ahead, l2, ln.programs, err)


@needs_compiler
def test_gpu_table_choice_replays_in_a_cuda_graph_with_new_inputs():
    """The table's stream kernel through ``quant_gemv.compile`` (pdl, two programs per SM), captured once
    and replayed with new x: every output written, against float64."""
    dev = _gpu()
    if tuple(dev.capability) != (9, 0):
        pytest.skip(f"the sm_90 table takes the stream kernel; this device is {dev.arch}")
    from portakern.backends.triton import quant_gemv as Q
    from portakern.validate import quant_gemv_op

    N, K = 6144, 2048
    w = weight(("g", "native", 4, 128, False, 1, N, K, "bfloat16", {}))
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    op, _ = quant_gemv_op(x, w.with_tensors({k: torch.as_tensor(v).cuda() for k, v in w.tensors.items()}))
    kern = Q.compile(op, dev)
    p = prepare_gemv_weight(w, dev)
    out = torch.full((1, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    kern(x, p, out)
    assert next(iter(kern.launchers.values())).kind == "stream"
    check_graph_replays(kern, x, p, out, w, TOL["bfloat16"])
