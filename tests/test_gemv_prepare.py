"""Preparing quantized weights: the torch (device) packers against the numpy reference bit for bit, quantize with
torch ops against the reference, the fragments-only layout, releasing native tensors, ``portakern.prepare`` /
``prepare_model``, and CUDA stream capture (simulated here by patching ``portakern.capture.is_capturing``: a call
that would prepare, measure or fall back raises ``CaptureError`` and tries no other backend).

The GPU half (a fresh weight's first call inside ``torch.cuda.graph``, resident bytes) is
``tests/test_gemv_prepare_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from portakern import Backend, CaptureError
from portakern import capture
from portakern.backend import YES
from portakern.devices import CPU
from portakern.errors import InvalidInputError, UnsupportedError
from portakern.gemv_weight import GEMV_LAYOUT, dequantize_prepared, prepare_gemv_weight
from portakern.ir import DType, packing
from portakern.quantize_torch import quantize_native as quantize_native_torch
from gemv_cases import CASES, weight
from plugin_helpers import provides


def _distinct_cases():
    """One case per distinct weight (packing, bits, group, symmetry, N, K, g_idx, scale dtype, zeros)."""
    seen, out = set(), []
    for case in CASES:
        key = case[1:5] + case[6:8] + tuple(sorted((k, str(v)) for k, v in case[9].items() if k != "config"))
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


WEIGHT_CASES = _distinct_cases()


def _torch_weight(w):
    return w.with_tensors({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in w.tensors.items()})


@pytest.mark.parametrize("layout", ["words+fragments", "fragments", "words"])
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_torch_packers_match_the_numpy_reference_bit_for_bit(case, layout):
    w = weight(case)
    ref = prepare_gemv_weight(w, CPU, fragments=True, layout=layout)        # numpy arrays: the host reference
    got = prepare_gemv_weight(_torch_weight(w), CPU, fragments=True, layout=layout)   # torch tensors: torch ops
    for name in ("qweight", "scales", "zeros", "perm", "kgroup", "frag"):
        a, b = getattr(ref, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert (got.zero_point, got.KWP, got.stride_qk, got.interleave) == \
        (ref.zero_point, ref.KWP, ref.stride_qk, ref.interleave)
    # the prepared copy holds the weight exactly: dequantized from it (words or fragments) = the reference
    exact = packing.dequantize(w.fmt, {k: np.asarray(v) for k, v in w.tensors.items()}, w.N, w.K)
    np.testing.assert_array_equal(dequantize_prepared(got), exact)


def test_fragments_layout_holds_each_code_once_where_the_format_allows():
    frag_case = next(c for c in WEIGHT_CASES if c[1] == "native" and c[2] == 4 and c[3] == 128)
    p = prepare_gemv_weight(_torch_weight(weight(frag_case)), CPU, fragments=True, layout="fragments")
    assert p.qweight is None and p.frag is not None and not p.has_words
    assert p.KWP == prepare_gemv_weight(weight(frag_case), CPU, fragments=True).KWP
    int8 = next(c for c in WEIGHT_CASES if c[2] == 8)   # no fragment layout for int8: the words stay
    q = prepare_gemv_weight(_torch_weight(weight(int8)), CPU, fragments=True, layout="fragments")
    assert q.qweight is not None and q.frag is None
    with pytest.raises(InvalidInputError, match="layout='tiles' is not a GEMV weight layout: choose one of"):
        prepare_gemv_weight(weight(int8), CPU, layout="tiles")


def test_fragments_only_weight_runs_the_cpu_op_and_refuses_triton_kernels_it_cannot_use():
    from portakern.backends.triton.quant_gemv.config import choose
    from portakern.torch_ops import _quant_gemv_impl

    case = next(c for c in WEIGHT_CASES if c[1] == "native" and c[2] == 4 and c[3] == 128)
    w = weight(case)
    p = prepare_gemv_weight(_torch_weight(w), CPU, fragments=True, layout="fragments")
    x = torch.randn(3, w.K, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).float()
    exact = packing.dequantize(w.fmt, {k: np.asarray(v) for k, v in w.tensors.items()}, w.N, w.K)
    np.testing.assert_allclose(_quant_gemv_impl(x, p, None).double().numpy(), x.double().numpy() @ exact.T,
                               rtol=1e-5, atol=1e-4)
    assert choose(p, 1, w.N, "sm_90", 132, dtype="bfloat16").kind == "frag"      # M = 1 reads the fragments too
    assert choose(p, 16, w.N, "sm_90", 132, dtype="bfloat16").kind == "frag"
    with pytest.raises(UnsupportedError, match="only in the fragment layout .*dtype=float16 .*layout='words\\+fragm"):
        choose(p, 1, w.N, "sm_90", 132, dtype="float16")
    with pytest.raises(UnsupportedError, match="a prologue reads x on the CUDA-core kernel"):
        choose(p, 1, w.N, "sm_90", 132, dtype="bfloat16", cuda_core=True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_quantize_with_torch_ops_matches_the_numpy_reference(bits, symmetric, scale_dtype):
    rng = np.random.default_rng(bits * 7 + symmetric)
    w = rng.standard_normal((24, 256)) * np.array([1e-3, 1.0, 300.0])[rng.integers(0, 3, (24, 1))]
    w[0, :32] = 0.0                           # an all-zero group: scale 1
    w[1, :32] = np.abs(w[1, :32])             # a group without negatives: zero point 0
    for dt in (np.float64, np.float32, np.float16):
        ref, f_ref = packing.quantize_native(w.astype(dt), bits, 32, symmetric, scale_dtype)
        got, f_got = quantize_native_torch(torch.from_numpy(w.astype(dt)), bits, 32, symmetric, scale_dtype)
        assert f_ref == f_got and sorted(ref) == sorted(got)
        for name, a in ref.items():
            b = got[name].float() if got[name].dtype == torch.bfloat16 else got[name]   # numpy keeps bf16 in f32
            assert a.dtype == b.numpy().dtype and np.array_equal(a, b.numpy()), (name, dt)


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False)])
def test_quantize_with_torch_ops_rounds_quotients_next_to_a_tie_as_the_reference(bits, symmetric, scale_dtype):
    """``round(w / scale)`` runs in float32 where ``quotient_dtype`` proves it rounds as float64 does. Groups whose
    scale is exactly ``s0`` hold float32 weights on every tie ``(n + 1/2) s0`` and one unit in the last place either
    side of it: the codes are the reference's bits (a float16 division would round some of them the other way: the
    data is checked to contain such quotients). A bfloat16 weight, which numpy lacks, gives the bits of its float32
    copy."""
    s0 = 0.013671875                                         # 7 / 512: exact in fp16, bf16 and fp32
    top = (1 << (bits - 1)) - 1
    lo, hi = (-top if symmetric else -top - 1), top           # the group's extremes: its scale is exactly s0
    ties = ((np.arange(lo, hi) + 0.5) * s0).astype(np.float32)
    vals = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    g = -(-(vals.size + 2) // 64) * 64
    w = np.zeros((2, g), np.float32)
    w[:, :vals.size] = vals
    w[:, vals.size:vals.size + 2] = (lo * s0, hi * s0)
    w[1, :vals.size] = vals[::-1]
    coarse = np.round((vals.astype(np.float16) / np.float16(s0)).astype(np.float64))
    assert (coarse != np.round(vals.astype(np.float64) / s0)).any()   # near-tie quotients a coarse division misrounds
    ref, _ = packing.quantize_native(w, bits, g, symmetric, scale_dtype)
    got, _ = quantize_native_torch(torch.from_numpy(w), bits, g, symmetric, scale_dtype)
    assert float(got["scales"].float()[0, 0]) == s0
    for name, a in ref.items():
        b = got[name].float() if got[name].dtype == torch.bfloat16 else got[name]
        assert np.array_equal(a, b.numpy()), name
    wb = torch.from_numpy(np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)).bfloat16()
    ref, _ = packing.quantize_native(wb.float().numpy(), bits, 128, symmetric, scale_dtype)
    got, _ = quantize_native_torch(wb, bits, 128, symmetric, scale_dtype)
    for name, a in ref.items():
        b = got[name].float() if got[name].dtype == torch.bfloat16 else got[name]
        assert np.array_equal(a, b.numpy()), name


def test_quotient_dtype_keeps_float64_where_float32_would_round_differently():
    """float32 quotients only for float16 / bfloat16 / float32 weights over float16 / bfloat16 scales; a float32
    scale has too many significant bits: this pair's float32 quotient lands on the other side of a tie."""
    from portakern.quantize_torch import quotient_dtype

    assert quotient_dtype(torch.float32, DType.float16) is torch.float32
    assert quotient_dtype(torch.bfloat16, DType.bfloat16) is torch.float32
    assert quotient_dtype(torch.float64, DType.float16) is torch.float64
    assert quotient_dtype(torch.float16, DType.float32) is torch.float64
    w, s = np.float32(-0.35232562), np.float32(0.064059205)
    assert np.round(float(w) / float(s)) == -5.0 and np.round(np.float64(w / s)) == -6.0


def test_quantize_with_torch_ops_refuses_what_the_reference_refuses():
    w = torch.ones(4, 64, dtype=torch.float64)
    w[2, 5] = float("nan")
    with pytest.raises(InvalidInputError, match="w\\[2, 5\\]=nan: w must be finite"):
        quantize_native_torch(w, 4, 32, False, "float16")
    with pytest.raises(InvalidInputError, match="overflows scale_dtype=float16; pass scale_dtype='float32'"):
        quantize_native_torch(torch.full((2, 64), 1e9, dtype=torch.float64), 4, 32, False, "float16")


# -- releasing the native tensors -----------------------------------------------------------------------

def _prepared_on_cpu(case, layout="words+fragments"):
    w = _torch_weight(weight(case))
    w.prepared[(GEMV_LAYOUT, str(CPU))] = prepare_gemv_weight(w, CPU, fragments=True, layout=layout)
    return w


@pytest.mark.parametrize("layout", ["words+fragments", "fragments"])
def test_released_weight_dequantizes_from_its_prepared_copy_and_refuses_to_move(layout):
    case = next(c for c in WEIGHT_CASES if c[1] == "gptq" and c[9].get("g_idx") == "actorder")
    w = _prepared_on_cpu(case, layout)
    before = w.dequantize()
    w.release_native()
    assert w.native_released and w.tensors == {} and w.nbytes == 0 and w.prepared_nbytes > 0
    after = w.dequantize()
    assert isinstance(after, torch.Tensor) and after.dtype == torch.float32
    assert torch.equal(after, torch.as_tensor(before))
    assert w.to("cpu") is w
    with pytest.raises(InvalidInputError, match="native tensors were released after preparation .*keep_native=True"):
        w.to("cuda:0")
    with pytest.raises(InvalidInputError, match="has no native tensors .*no prepared copy for cuda:0"):
        prepare_gemv_weight(w, portakern.Device("cuda", 0))


def test_release_without_a_prepared_copy_is_refused():
    w = _torch_weight(weight(WEIGHT_CASES[0]))
    with pytest.raises(InvalidInputError, match="has no prepared GEMV copy, so its native tensors are its only copy"):
        w.release_native()
    assert not w.native_released


def test_prepare_on_the_cpu_keeps_the_native_tensors_and_checks_its_arguments():
    w = _torch_weight(weight(WEIGHT_CASES[0]))
    assert portakern.prepare(w) is w and not w.native_released and w.prepared == {}
    with pytest.raises(portakern.InvalidTypeError, match="portakern.prepare takes a portakern.QuantizedWeight"):
        portakern.prepare(np.zeros((4, 4)))
    with pytest.raises(InvalidInputError, match="layout='both' is not a GEMV weight layout"):
        portakern.prepare(w, layout="both")
    with pytest.raises(portakern.InvalidTypeError, match="keep_native='no' must be True or False"):
        portakern.prepare(w, keep_native="no")


def test_prepare_model_prepares_every_quantized_weight_a_module_holds(monkeypatch):
    import sys

    ahead = sys.modules["portakern.prepare_ahead"]
    calls = []
    monkeypatch.setattr(ahead, "prepare", lambda w, device, **kw: calls.append((w, device, kw)))
    a, b, c = (_torch_weight(weight(case)) for case in WEIGHT_CASES[:3])

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = a
            self.experts = [b, a]          # a held twice: prepared once
            self.register_buffer("bias", torch.zeros(3))

    model = torch.nn.Sequential(Block(), torch.nn.Module())
    model[1].table = {"c": c}
    assert ahead.prepare_model(model, layout="fragments") is model
    assert [(id(w), str(d), kw) for w, d, kw in calls] == [
        (id(a), "cpu", {"layout": "fragments", "keep_native": False}),
        (id(b), "cpu", {"layout": "fragments", "keep_native": False}),
        (id(c), "None", {"layout": "fragments", "keep_native": False})]
    with pytest.raises(portakern.InvalidTypeError, match="prepare_model takes a torch.nn.Module"):
        ahead.prepare_model([a])


# -- CUDA stream capture, simulated ---------------------------------------------------------------------

@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(capture, "is_capturing", lambda: True)


def test_preparing_inside_capture_raises_naming_the_weight_and_the_way_out(capturing):
    w = _torch_weight(weight(WEIGHT_CASES[0]))
    with pytest.raises(CaptureError) as e:
        prepare_gemv_weight(w, CPU)
    msg = str(e.value)
    assert f"weight (N, K)=({w.N}, {w.K}) native int4 group_size=128" in msg
    assert "inside CUDA stream capture" in msg and "portakern.prepare(weight, device=...)" in msg
    assert "run one call of this shape before capture" in msg
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, portakern.PortakernError)


def test_torch_ops_prepared_inside_capture_raises_unless_already_prepared(monkeypatch):
    from portakern.torch_ops import prepared

    w = _torch_weight(weight(WEIGHT_CASES[0]))
    monkeypatch.setattr(capture, "is_capturing", lambda: True)
    with pytest.raises(CaptureError, match="is not prepared for cpu"):
        prepared(w)
    monkeypatch.setattr(capture, "is_capturing", lambda: False)
    p = prepared(w)
    monkeypatch.setattr(capture, "is_capturing", lambda: True)
    assert prepared(w) is p            # a prepared weight needs nothing inside capture


class Flaky(Backend):
    """A numpy backend that fails at ``fail`` ("compile" or "run"), or fills ``out`` with ones; counts its calls."""

    array_kind = "numpy"
    device_types = ("cpu",)

    def __init__(self, name, priority, fail=None):
        self.name, self.priority, self.fail = name, priority, fail
        self.compile_calls = self.runs = 0

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        self.compile_calls += 1
        if self.fail == "compile":
            raise RuntimeError(f"{self.name}: operation not permitted when stream is capturing")

        def kernel(*args):
            self.runs += 1
            if self.fail == "run":
                raise RuntimeError(f"{self.name}: operation not permitted when stream is capturing")
            args[3].fill(1.0)
        return kernel


@pytest.mark.parametrize("stage", ["compile", "run"])
def test_no_fallback_inside_capture(register_plugin, capturing, stage):
    bad, spare = Flaky("bad", 90, fail=stage), Flaky("spare", 80)
    register_plugin(provides(bad, spare), name="flaky")
    q = np.linspace(-1, 1, 2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)
    with pytest.raises(CaptureError) as e:
        portakern.attention(q, q, q)
    msg = str(e.value)
    assert "attention" in msg and "bad failed" in msg and "RuntimeError: bad: operation not permitted" in msg
    assert "no other backend is tried there" in msg and "portakern.prepare" in msg
    assert isinstance(e.value.__cause__, RuntimeError)
    assert (spare.compile_calls, spare.runs) == (0, 0)     # the fallback backend was never tried
    assert bad.compile_calls == 1


def test_fastest_policy_does_not_measure_inside_capture(register_plugin, capturing, cache_dir):
    a, b = Flaky("one", 90), Flaky("two", 80)
    register_plugin(provides(a, b), name="two")
    q = np.linspace(-1, 1, 2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)
    with portakern.use_policy("fastest"), pytest.raises(CaptureError, match="the 'fastest' policy would time"):
        portakern.attention(q, q, q)
    assert (a.compile_calls, a.runs, b.compile_calls, b.runs) == (0, 0, 0, 0)


def test_outside_capture_the_fallback_still_happens(register_plugin):
    bad, spare = Flaky("bad", 90, fail="run"), Flaky("spare", 80)
    register_plugin(provides(bad, spare), name="flaky")
    q = np.linspace(-1, 1, 2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)
    with pytest.warns(portakern.FallbackWarning):
        out = portakern.attention(q, q, q)
    assert np.all(out == 1.0) and spare.runs == 1


def test_is_capturing_is_false_without_a_capture():
    assert capture.is_capturing() is False


class Reader(Backend):
    """A backend that says yes on cuda devices and reads ``weight_layout`` (its prepare_weight records calls)."""

    device_types = ("cuda",)

    def __init__(self, name, layout):
        self.name, self.weight_layout, self.prepared_by_me = name, layout, 0

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        raise AssertionError("prepare compiles nothing")

    def prepare_weight(self, weight, device):
        self.prepared_by_me += 1
        return ("own copy", self.name)


@pytest.mark.parametrize("other", [None, "own-layout"])
@pytest.mark.parametrize("keep_native", [False, True])
def test_prepare_for_a_gpu_builds_each_layout_once_and_releases_only_where_all_readers_read_it(
        register_plugin, monkeypatch, other, keep_native):
    import portakern.gemv_weight as gw

    cuda0 = portakern.Device("cuda", 0, arch="sm_90")
    built = []

    def fake_prepare(weight, device, *, fragments=None, layout=None):   # the GPU copy, made on the CPU here
        built.append((str(device), layout))
        return prepare_gemv_weight(weight, CPU, fragments=True, layout=layout)

    monkeypatch.setattr(gw, "prepare_gemv_weight", fake_prepare)
    readers = [Reader("ra", GEMV_LAYOUT), Reader("rb", GEMV_LAYOUT)] + ([Reader("rc", None)] if other else [])
    reg = register_plugin(provides(*readers), name="readers")
    for name in list(reg.backends):      # only the fake readers take part
        if name not in ("ra", "rb", "rc"):
            monkeypatch.delitem(reg.backends, name)
    w = _torch_weight(weight(WEIGHT_CASES[0]))
    exact = w.dequantize()
    assert portakern.prepare(w, cuda0, layout="fragments", keep_native=keep_native) is w
    assert built == [("cuda:0", "fragments")]                     # two readers of one layout: one copy
    assert (GEMV_LAYOUT, "cuda:0") in w.prepared
    assert w.native_released is (not keep_native and not other)   # a reader of its own layout needs the natives
    if other:
        assert w.prepared[("rc", "cuda:0")] == ("own copy", "rc") and readers[2].prepared_by_me == 1
    if w.native_released:
        assert torch.equal(w.dequantize(), torch.as_tensor(exact))
    portakern.prepare(w, cuda0)                                   # prepared already: nothing is built again
    assert len(built) == 1


def test_quant_linear_keeps_each_code_once_with_the_fragments_layout():
    from portakern.torch_ops import QuantLinear

    case = next(c for c in WEIGHT_CASES if c[1] == "native" and c[2] == 4 and c[3] == 128)
    w = _prepared_on_cpu(case)                       # a CPU copy with fragments, as a GPU's would have
    exact = torch.as_tensor(w.dequantize()).double()
    x = torch.randn(3, w.K, generator=torch.Generator().manual_seed(2))
    model = torch.nn.Sequential(QuantLinear(w))
    assert model[0].qweight is not None and model[0].frag is not None and "frag" not in model.state_dict()
    portakern.prepare_model(model, layout="fragments")
    lin = model[0]
    assert lin.qweight is None and "frag" in lin.state_dict() and "qweight" not in lin.state_dict()
    torch.testing.assert_close(lin(x).double(), x.double() @ exact.T, rtol=1e-5, atol=1e-4)
    again = QuantLinear(_prepared_on_cpu(case))
    again.use_layout("fragments")
    again.load_state_dict(lin.state_dict())          # a fragments-only state dict loads into the same layout
    assert torch.equal(again.frag, lin.frag)
    with pytest.raises(InvalidInputError, match="holds its codes only as fragments"):
        lin.use_layout("words")
    with pytest.raises(InvalidInputError, match="layout='tiles' is not a GEMV weight layout"):
        lin.use_layout("tiles")
