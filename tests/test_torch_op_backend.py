"""Which backend ``torch.ops.portakern.quant_gemv`` runs on CUDA (``torch_ops.gemv_kernel``): the one dispatch ranks
first among those that read the GEMV weight layout (``portakern.gemv_weight``), and the op it builds from a prepared weight (``gemv_op_of``).
Off the GPU: the backends' ``compile`` is replaced by a recorder, and the device is a described sm_90 card."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gemv_cases import CASES, weight  # noqa: E402
from plugin_helpers import provides  # noqa: E402

import portakern  # noqa: E402
from portakern import dispatch, torch_ops  # noqa: E402
from portakern.devices import Device  # noqa: E402
from portakern.errors import InvalidInputError, UnsupportedError  # noqa: E402
from portakern.ir import DType, Packing, QuantFormat  # noqa: E402
from portakern.ir.ops import QuantGemv  # noqa: E402
from portakern.lru import LRU  # noqa: E402

H200 = Device("cuda", 0, arch="sm_90a", name="H200 (test)", capability=(9, 0), warp_size=32)


def _case(cid):
    return next(c for c in CASES if c[0] == cid)


def _gemv(M=1, N=28672, K=4096, prologue=None):
    return QuantGemv(M=M, N=N, K=K, dtype=DType.bfloat16, fmt=QuantFormat(bits=4, group_size=128, symmetric=False),
                     prologue=prologue)


@pytest.fixture
def recorded(fresh_registry, monkeypatch):
    """The triton and cuda backends with ``compile`` returning ``("compiled", backend name, op)``, for weights that
    hold words (layout "words+fragments": the word kernel's table ranks; the default, fragments only:
    ``test_fragments_only_ops_rank_by_the_fragment_kernels_table``)."""
    from portakern import gemv_weight
    from portakern.backends.cuda.common.nvrtc import unavailable

    if unavailable() is not None:
        pytest.skip(f"the cuda backend cannot rank here: {unavailable()}")
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "words+fragments")
    return _record(monkeypatch)


def test_fragments_only_ops_rank_by_the_fragment_kernels_table(recorded, monkeypatch):
    # the default layout: int4 g128 weights hold only fragments, so cuda runs first where its fragment kernel was
    # measured ahead (FRAG_TABLE: H100 entries) and for fp16 x (triton's fragment kernel is bf16-only), else triton
    from portakern import gemv_weight

    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", "fragments")
    monkeypatch.setattr(gemv_weight, "wants_fragments", lambda device: True)
    h100 = Device("cuda", 0, arch="sm_90a", name="NVIDIA H100 80GB HBM3", capability=(9, 0), warp_size=32)
    fp16 = QuantGemv(M=1, N=28672, K=4096, dtype=DType.float16, fmt=_gemv().fmt)
    for op, dev, want in [(_gemv(N=28672, K=8192), h100, "cuda"), (_gemv(N=28672, K=8192), H200, "triton"),
                          (_gemv(), H200, "triton"), (fp16, H200, "cuda"), (_gemv(M=8), h100, "triton")]:
        assert torch_ops.gemv_kernel(op, dev)[0] == want, (op, dev.name)
        assert dispatch.decide(op, dev, None).order[0].name == want


def _record(monkeypatch):
    """Replace the registered triton and cuda backends' ``compile`` (again after the registry is rebuilt)."""
    regs = {b.name: b for b in portakern.list_backends()}
    for name in ("triton", "cuda"):
        monkeypatch.setattr(regs[name], "compile", lambda op, device, n=name: ("compiled", n, op))
    return regs


@pytest.mark.parametrize("op,want", [
    (_gemv(), "cuda"),                                 # gemv_table: measured ahead of triton on sm_90
    (_gemv(N=128256), "cuda"),
    (_gemv(N=4096), "triton"),                         # measured, not ahead
    (_gemv(N=5120, K=5120), "triton"),                 # unmeasured: cuda ranks below triton
    (_gemv(M=8), "triton"),                            # past the cuda kernel's M = 4
    (_gemv(K=4096, N=28672, prologue="silu_mul"), "triton"),   # a prologue the cuda kernel lacks
])
def test_the_op_runs_the_backend_dispatch_ranks_first_among_the_layouts_readers(recorded, op, want):
    name, kernel = torch_ops.gemv_kernel(op, H200)
    assert name == want and kernel == ("compiled", want, op)
    assert dispatch.decide(op, H200, None).order[0].name == want     # what portakern.quant_gemv would run first


def test_a_forced_backend_is_honoured_or_refused_with_the_way_out(recorded, register_plugin, monkeypatch):
    with dispatch.use_backend("triton"):
        assert torch_ops.gemv_kernel(_gemv(), H200)[0] == "triton"     # even where cuda ranks first
    with dispatch.use_backend("cuda"), pytest.raises(UnsupportedError, match="not supported by cuda"):
        torch_ops.gemv_kernel(_gemv(prologue="silu_mul"), H200)

    class OwnLayout(type(recorded["triton"])):                         # supports what triton does, own layout
        name, priority, weight_layout = "own-layout", 5, "own"

    register_plugin(provides(OwnLayout()), name="own")               # a new registry: record its backends too
    _record(monkeypatch)
    with dispatch.use_backend("own-layout"), pytest.raises(UnsupportedError) as e:
        torch_ops.gemv_kernel(_gemv(), H200)
    msg = str(e.value)
    assert "'gemv-tiled' layout" in msg and "'own-layout'" in msg and "portakern.quant_gemv" in msg
    assert torch_ops.gemv_kernel(_gemv(), H200)[0] == "cuda"           # unforced, the own layout is passed over


def test_a_backend_that_fails_to_compile_falls_back_with_a_warning(recorded, monkeypatch):
    def broken(op, device):
        raise RuntimeError("nvrtc: out of luck")

    monkeypatch.setattr(recorded["cuda"], "compile", broken)
    dispatch._warned.clear()
    with pytest.warns(dispatch.FallbackWarning, match="out of luck"):
        assert torch_ops.gemv_kernel(_gemv(), H200)[0] == "triton"
    monkeypatch.setenv("PORTAKERN_STRICT", "1")
    with pytest.raises(portakern.errors.StrictModeError, match="out of luck"):
        torch_ops.gemv_kernel(_gemv(), H200)


@pytest.mark.parametrize("cid,bits,sym,packing,g_idx,sdt", [
    ("native4-sym-g64-m1-bf16", 4, True, Packing.NATIVE, False, DType.float16),
    ("native4-asym-g64-m1-f32-scalebf16", 4, False, Packing.NATIVE, False, DType.bfloat16),
    ("native8-sym-gK-m4-f16", 8, True, Packing.NATIVE, False, DType.float16),
    ("gguf-q4_0-m1-f16", 4, True, Packing.NATIVE, False, DType.float16),
    ("gptq-actorder-m2-f32", 4, False, Packing.GPTQ, True, DType.float16),
    ("gptq-irregular-m1-f32", 4, False, Packing.GPTQ, True, DType.float16),
])
def test_the_op_of_a_prepared_weight_states_its_storage(cid, bits, sym, packing, g_idx, sdt):
    # the cuda kernel bakes the scale dtype, the zero point and the group walk in: the op must say what is stored
    case = _case(cid)
    w = torch_ops.prepared(weight(case), "cpu")
    x = torch.zeros(case[5], w.K, dtype=getattr(torch, case[8]))
    op = torch_ops.gemv_op_of(x, w)
    f = op.fmt
    assert (op.M, op.N, op.K, op.dtype.value) == (case[5], case[6], case[7], case[8])
    assert (f.bits, f.group_size, f.symmetric, f.packing, f.has_g_idx, f.scale_dtype) == \
        (bits, w.group_size, sym, packing, g_idx, sdt)
    if sym:
        assert f.zero_point == w.zero_point


def test_gguf_q8_0_keeps_its_offset_codes_zero_point():
    # Q8_0's signed codes are stored offset by 128, zero point 128: a native symmetric int8 format
    w = torch_ops.prepared(weight(_case("gguf-q8_0-m1-f32")), "cpu")
    op = torch_ops.gemv_op_of(torch.zeros(1, w.K), w)
    assert w.zero_point == 128 == op.fmt.zero_point and op.fmt.packing is Packing.NATIVE


def test_a_prepared_weight_with_a_foreign_zero_point_is_refused():
    from dataclasses import replace

    w = torch_ops.prepared(weight(_case("native4-sym-g64-m1-bf16")), "cpu")
    with pytest.raises(InvalidInputError, match="zero point is 3.*has 8.*prepared"):
        torch_ops.gemv_op_of(torch.zeros(1, w.K), replace(w, zero_point=3))


def test_the_op_on_the_cpu_still_matches_float64_for_every_storage():
    # the CPU path does not consult gemv_kernel; the same weights through it against float64 (a control for above)
    from portakern.ir.packing import dequantize

    for cid in ("native4-asym-g64-m1-f32-scalebf16", "gptq-irregular-m1-f32", "gguf-q8_0-m1-f32"):
        w = weight(_case(cid))
        x = torch.randn(2, w.K)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = torch_ops.quant_linear(x, w)
        ref = x.double().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T
        np.testing.assert_allclose(y.double().numpy(), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the cuda backend's kernel")
@pytest.mark.parametrize("layout", ["fragments", "words+fragments"])
def test_the_op_runs_the_cuda_kernel_where_its_table_wins_in_a_graph_and_compiled(monkeypatch, layout):
    # a small shape marked as a measured win for this GPU's family (in the table of the kernel that reads the
    # default layout: FRAG_TABLE for fragments, TABLE for words): the op must then run the cuda kernel, with
    # values against float64, replayed in a CUDA graph with new inputs and under torch.compile
    from portakern import gemv_weight
    from portakern.backends.cuda import tuning as gemv_table
    from portakern.backends.cuda.quant_gemv import family
    from portakern.devices import torch_device
    from portakern.ir.packing import dequantize
    from portakern.quantize import quantize

    dev = torch_device("cuda", 0)
    monkeypatch.setattr(gemv_weight, "DEFAULT_LAYOUT", layout)
    if layout == "fragments":
        monkeypatch.setitem(gemv_table.FRAG_TABLE, (family(dev.capability), 1, 640, 1024),
                            gemv_table.FragEntry(2, 2, 1, 2, 1, 1, "test"))
    else:
        monkeypatch.setitem(gemv_table.TABLE, (family(dev.capability), 1, 4, 640, 1024), (16, 4, 2, 2, 1, True))
    monkeypatch.setattr(torch_ops, "_kernels", LRU(8))
    w = quantize(torch.randn(640, 1024, device="cuda"), bits=4, group_size=128)
    lin = torch_ops.QuantLinear(w)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch_ops.gemv_kernel(torch_ops.gemv_op_of(x, lin._prepared_weight()), dev)[0] == "cuda"
    wd = dequantize(w.fmt, {k: v.cpu().numpy() for k, v in w.tensors.items()}, 640, 1024).T

    def close(y, x):
        ref = x.double().cpu().numpy() @ wd
        np.testing.assert_allclose(y.double().cpu().numpy(), ref, atol=1e-2 * np.abs(ref).max())

    close(lin(x), x)
    compiled = torch.compile(lin, backend="eager", fullgraph=True)
    close(compiled(x), x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = lin(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        g.replay()
        close(y, x)
    assert any(k[1:3] == (640, 1024) for k in torch_ops._kernels)
