"""portakern's torch custom ops: values, fake implementations, torch.compile, CUDA graphs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gemv_cases import CASES, weight  # noqa: E402

from portakern import torch_ops  # noqa: E402
from portakern.ir.packing import dequantize  # noqa: E402

PICK = [c for c in CASES if c[0] in ("native4-asym-g32-m3-f32", "awq-g32-m1-f16", "gptq-actorder-m2-f32",
                                     "gptq-irregular-m1-f32", "gguf-q8_0-m1-f32", "native8-sym-gK-m4-f16",
                                     "native4-asym-g100-m2-f16-perelem")]


def _reference(x: torch.Tensor, w) -> np.ndarray:
    return x.double().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T


@pytest.mark.parametrize("case", PICK, ids=[c[0] for c in PICK])
def test_quant_linear_matches_float64(case):
    w = weight(case)
    x = torch.randn(3, 2, w.K)  # leading dims are flattened and restored
    y = torch_ops.quant_linear(x, w)
    assert y.shape == (3, 2, w.N)
    ref = _reference(x.reshape(-1, w.K), w).reshape(3, 2, w.N)
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_opcheck_quant_gemv_and_attention():
    w = weight(PICK[0])
    p = torch_ops.prepared(w, "cpu")
    x = torch.randn(2, w.K)
    torch.library.opcheck(torch.ops.portakern.quant_gemv.default,
                          (x, p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits, p.group_size, p.zero_point,
                           p.N, p.K))
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    torch.library.opcheck(torch.ops.portakern.attention.default, (q, k, v, None, None, True, None, -1, -1, 0.0))


class _Block(torch.nn.Module):
    """A tiny attention block: quantized q/k/v/o projections around portakern attention."""

    def __init__(self, wq, wkv, wo, heads=4, kv_heads=2, dim=16):
        super().__init__()
        self.q, self.kv, self.o = (torch_ops.QuantLinear(w, "cpu") for w in (wq, wkv, wo))
        self.h, self.hk, self.d = heads, kv_heads, dim

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d)
        k, v = self.kv(x).view(B, S, 2, self.hk, self.d).unbind(2)
        a = torch_ops.attention_op(q, k.contiguous(), v.contiguous(), causal=True)
        return x + self.o(torch.nn.functional.silu(a.reshape(B, S, -1)))


def test_torch_compile_module_with_custom_ops():
    from portakern.quantize import quantize

    torch.manual_seed(0)
    wq = quantize(torch.randn(64, 64), bits=4, group_size=32)
    wkv = quantize(torch.randn(64, 64), bits=8, group_size=64, symmetric=True)
    wo = quantize(torch.randn(64, 64), bits=4, group_size=64)
    block = _Block(wq, wkv, wo)
    x = torch.randn(2, 5, 64)
    eager = block(x)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    # the eager module against an independent float64 computation
    import portakern

    def lin(w, t):
        return t.double().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T

    xs = x.reshape(-1, 64)
    q = torch.from_numpy(lin(wq, xs)).float().view(2, 5, 4, 16)
    kv = torch.from_numpy(lin(wkv, xs)).float().view(2, 5, 2, 2, 16)
    a = portakern.attention(q, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous(), causal=True, backend="cpu")
    ref = xs.double().numpy() + lin(wo, torch.nn.functional.silu(a.reshape(10, 64)))
    np.testing.assert_allclose(eager.reshape(10, 64).double().numpy(), ref, rtol=0, atol=1e-3)


class _Mlp(torch.nn.Module):
    """A gated MLP: one quantized gate/up projection, the down projection with the silu_mul prologue."""

    def __init__(self, wgu, wd):
        super().__init__()
        self.wgu, self.wd = wgu, wd

    def forward(self, x):
        return torch_ops.quant_linear(torch_ops.quant_linear(x, self.wgu), self.wd, prologue="silu_mul")


def test_silu_mul_prologue_matches_float64_and_compiles():
    """``prologue="silu_mul"``: values against float64 (``gate / (1 + exp(-gate)) * up`` written out), the op's
    fake implementation (opcheck), and a gated MLP under ``torch.compile`` equal to eager."""
    from portakern.quantize import quantize

    torch.manual_seed(1)
    wgu = quantize(torch.randn(2 * 96, 64), bits=4, group_size=32)
    wd = quantize(torch.randn(64, 96), bits=8, group_size=32)
    x = torch.randn(3, 2, 2 * 96)
    y = torch_ops.quant_linear(x, wd, prologue="silu_mul")
    xs = x.reshape(-1, 192).double().numpy()
    inp = xs[:, :96] / (1.0 + np.exp(-xs[:, :96])) * xs[:, 96:]
    ref = (inp @ dequantize(wd.fmt, wd.tensors, 64, 96).T).reshape(3, 2, 64)
    assert y.shape == (3, 2, 64)
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    p = torch_ops.prepared(wd, "cpu")
    torch.library.opcheck(torch.ops.portakern.quant_gemv.default,
                          (x.reshape(-1, 192), p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits, p.group_size,
                           p.zero_point, p.N, p.K, "silu_mul"))
    mlp = _Mlp(wgu, wd)
    h = torch.randn(2, 5, 64)
    eager = mlp(h)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(mlp, backend="aot_eager", fullgraph=True)(h), eager, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"x has 96 columns .* x must be \(\.\.\., 2 \* 96\) with prologue='silu_mul'"):
        torch_ops.quant_linear(torch.randn(2, 96), wd, prologue="silu_mul")
    with pytest.raises(ValueError, match=r"prologue='relu' is not a quant_gemv prologue"):
        torch_ops.quant_linear(x, wd, prologue="relu")


def test_quant_linear_rejects_wrong_k():
    w = weight(PICK[0])
    with pytest.raises(ValueError, match=f"x must be \\(..., {w.K}\\)"):
        torch_ops.quant_linear(torch.randn(2, w.K + 1), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the triton kernel")
def test_cuda_graph_and_compile_on_gpu():
    from portakern.quantize import quantize

    w = quantize(torch.randn(512, 1024, device="cuda"), bits=4, group_size=128)
    lin = torch_ops.QuantLinear(w)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    ref = x.double().cpu().numpy() @ dequantize(w.fmt, {k: v.cpu().numpy() for k, v in w.tensors.items()},
                                               512, 1024).T
    compiled = torch.compile(lin, backend="eager", fullgraph=True)
    np.testing.assert_allclose(compiled(x).double().cpu().numpy(), ref, atol=2e-3 * np.abs(ref).max())
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = lin(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    ref = x.double().cpu().numpy() @ dequantize(w.fmt, {k: v.cpu().numpy() for k, v in w.tensors.items()},
                                               512, 1024).T
    np.testing.assert_allclose(y.double().cpu().numpy(), ref, atol=2e-3 * np.abs(ref).max())


def _dispatched(fn) -> set[str]:
    """The portakern ops torch's dispatcher saw while ``fn`` ran (the profiler records dispatched ops, and
    installs no mode that would change the path taken)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()} & {"portakern::quant_gemv", "portakern::attention"}


class _LogMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_run_directly_and_traced_calls_dispatch():
    """Plain eager calls of quant_linear, QuantLinear and attention_op skip torch's operator dispatch (~50 us of
    host time a call) with the same values as the op; a dispatch mode, or an x that requires grad, sees the
    custom op."""
    from portakern.quantize import quantize

    torch.manual_seed(3)
    w = quantize(torch.randn(48, 64), bits=4, group_size=32)
    lin = torch_ops.QuantLinear(w, "cpu")
    p = torch_ops.prepared(w, "cpu")
    x = torch.randn(2, 64)
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    calls = {
        "quant_linear": lambda t: torch_ops.quant_linear(t, w),
        "QuantLinear": lambda t: lin(t),
        "attention_op": lambda t: torch_ops.attention_op(q, k, v, causal=True),
    }
    via_op = {
        "quant_linear": lambda t: torch.ops.portakern.quant_gemv(t, p.qweight, p.scales, p.zeros, p.perm, p.kgroup,
                                                                 p.bits, p.group_size, p.zero_point, p.N, p.K),
        "attention_op": lambda t: torch.ops.portakern.attention(q, k, v, None, None, True, None, -1, -1, 0.0),
    }
    via_op["QuantLinear"] = via_op["quant_linear"]
    for name, call in calls.items():
        assert _dispatched(lambda: call(x)) == set(), name
        torch.testing.assert_close(call(x), via_op[name](x), rtol=0, atol=0)
        mode = _LogMode()
        with mode:
            call(x)
        assert any(op.startswith("portakern.") for op in mode.ops), (name, mode.ops)
    for name in ("quant_linear", "QuantLinear"):
        assert _dispatched(lambda: calls[name](x.clone().requires_grad_())) == {"portakern::quant_gemv"}, name
    with warnings.catch_warnings():   # torch.jit.trace is deprecated, still used
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(lin, (x,), check_trace=False)   # the JIT tracer records the op, not its insides
    assert "portakern::quant_gemv" in str(traced.graph)
    torch.testing.assert_close(traced(x), lin(x), rtol=0, atol=0)


def test_meta_tensors_and_vmap_take_the_dispatched_op():
    """The direct eager path is for plain CPU / CUDA tensors only: meta tensors get the op's fake result (shape,
    dtype, no data) and ``torch.func.vmap`` batches the op, as when called through ``torch.ops``."""
    from portakern.quantize import quantize

    torch.manual_seed(4)
    q = torch.empty(1, 1, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 16, 8, 64, device="meta", dtype=torch.bfloat16)
    out = torch_ops.attention_op(q, k, k)
    assert out.device.type == "meta" and tuple(out.shape) == (1, 1, 8, 64) and out.dtype == torch.bfloat16
    lin = torch_ops.QuantLinear(quantize(torch.randn(48, 64), bits=4, group_size=32), "cpu")
    xs = torch.randn(4, 2, 64)
    batched = torch.func.vmap(lin)(xs)
    torch.testing.assert_close(batched, torch.stack([lin(x) for x in xs]), rtol=0, atol=0)


def test_quant_linear_carries_the_fragment_layout_and_reuses_its_prepared_weight(monkeypatch):
    """``QuantLinear`` keeps the prepared weight's fragment layout (what the M = 2..16 CUDA table runs) as a buffer
    and hands it to the kernel on both paths -- eager, and through ``torch.ops`` (compile, graphs) -- where before
    the op rebuilt the weight without it; eager calls reuse one ``PreparedGemvWeight`` until a buffer object
    changes."""
    from portakern.quantize import quantize

    torch.manual_seed(5)
    lin = torch_ops.QuantLinear(quantize(torch.randn(48, 128), bits=4, group_size=128), "cpu")
    assert "frag" in lin._buffers and lin.frag is None                      # a CPU weight has none
    frag = torch.zeros(1, 3, 256, dtype=torch.int32)      # stands in for the CUDA-only fragment layout
    lin.frag = frag
    seen = []
    real = torch_ops._quant_gemv_impl
    monkeypatch.setattr(torch_ops, "_quant_gemv_impl", lambda x, w, pro: seen.append(w) or real(x, w, pro))
    x = torch.randn(2, 128)
    y0 = lin(x)
    lin(x)
    assert seen[0].frag is frag and seen[1] is seen[0]                      # eager: the same prepared weight
    y1 = lin(x.clone().requires_grad_())                                    # dispatched through torch.ops
    assert seen[2].frag is frag and seen[2] is not seen[0]
    torch.testing.assert_close(y1.detach(), y0, rtol=0, atol=0)
    lin._apply(lambda t: t.clone())                                         # new buffer objects (as .to does)
    lin(x)
    assert seen[3] is not seen[0] and seen[3].qweight is lin.qweight and seen[3].frag is lin.frag


def test_fragment_layout_is_derived_not_saved_and_follows_loaded_codes():
    """``frag`` (present on CUDA) is derived from ``qweight``: it stays out of the state dict (CPU- and CUDA-built
    modules load each other's), and ``load_state_dict`` rebuilds it from the loaded codes, so M = 2..16 never
    reads a previous weight's codes."""
    import numpy as np

    from portakern.ir.gemv_layout import N_ALIGN_WORDS, pack_fragments
    from portakern.ir.packing import unpack
    from portakern.quantize import quantize

    torch.manual_seed(6)
    w_old, w_new = (quantize(torch.randn(40, 256), bits=4, group_size=128) for _ in range(2))

    def frag_of(w):   # what prepare_weight builds on a CUDA device
        codes = unpack(w.fmt, {k: np.asarray(v) for k, v in w.tensors.items()}, w.N, w.K)[0]
        return torch.from_numpy(pack_fragments(codes, N_ALIGN_WORDS))

    lin = torch_ops.QuantLinear(w_old, "cpu")
    lin.frag = frag_of(w_old)                            # as a CUDA-built module has it
    state = torch_ops.QuantLinear(w_new, "cpu").state_dict()
    assert "frag" not in state and "frag" not in lin.state_dict()
    lin.load_state_dict(state)                           # strict: no missing or unexpected key
    torch.testing.assert_close(lin.frag, frag_of(w_new), rtol=0, atol=0)
    assert not torch.equal(lin.frag, frag_of(w_old))


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_state_dict_of_either_layout_loads_into_a_module_of_the_other(symmetric):
    """A module whose codes are words (CPU, or "words+fragments") and one whose codes are only fragments (the CUDA
    default) read each other's state dicts: the codes are repacked into the loading module's layout, and its output
    is then the saved weight's (float64 reference), not the weight it was built from."""
    from portakern.devices import CPU
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.quantize import quantize

    torch.manual_seed(8)
    w_saved, w_built = (quantize(torch.randn(40, 256), bits=4, group_size=128, symmetric=symmetric)
                        for _ in range(2))
    x = torch.randn(3, 256)
    ref = _reference(x, w_saved)

    def fragments_only(w):
        return torch_ops.QuantLinear(prepare_gemv_weight(w, CPU, fragments=True, layout="fragments"))

    words_state = torch_ops.QuantLinear(w_saved, "cpu").state_dict()
    frag_state = fragments_only(w_saved).state_dict()
    assert "qweight" in words_state and "frag" not in words_state
    assert "frag" in frag_state and "qweight" not in frag_state

    into_frags = fragments_only(w_built)
    into_frags.load_state_dict(words_state)              # strict: no missing or unexpected key
    assert into_frags.qweight is None
    torch.testing.assert_close(into_frags.frag, frag_state["frag"], rtol=0, atol=0)
    np.testing.assert_allclose(into_frags(x).double().numpy(), ref, rtol=1e-4, atol=1e-4)

    into_words = torch_ops.QuantLinear(w_built, "cpu")
    into_words.load_state_dict(frag_state)
    torch.testing.assert_close(into_words.qweight, words_state["qweight"], rtol=0, atol=0)
    np.testing.assert_allclose(into_words(x).double().numpy(), ref, rtol=1e-4, atol=1e-4)
    assert "frag" in frag_state and "qweight" in words_state   # the caller's dicts are theirs: copies were read


def test_op_and_fake_refuse_an_x_the_kernel_would_misread():
    """``torch.ops.portakern.quant_gemv`` takes a 2-D ``x (M, K)``: a 1-D x used to come back as ``(K, N)`` with
    one row broadcast over all of them (CPU), and the fake implementation returned ``(M, N)`` for any width, so a
    traced graph accepted shapes the kernel misreads. Both now raise the project's error naming x's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from portakern.errors import InvalidInputError
    from portakern.quantize import quantize

    torch.manual_seed(7)
    p = torch_ops.prepared(quantize(torch.randn(48, 64), bits=4, group_size=32), "cpu")

    def call(x, prologue=None):
        return torch.ops.portakern.quant_gemv(x, p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits,
                                              p.group_size, p.zero_point, p.N, p.K, prologue)

    bad = [((64,), None, r"\(64,\)"), ((3, 65), None, r"\(3, 65\)"), ((3, 64, 1), None, r"\(3, 64, 1\)"),
           ((3, 64), "silu_mul", r"2 \* 64")]
    for shape, prologue, fragment in bad:
        with pytest.raises(InvalidInputError, match=fragment):
            call(torch.randn(*shape), prologue)
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(InvalidInputError, match=fragment):
            call(torch.randn(*shape), prologue)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert tuple(call(torch.randn(3, 64)).shape) == (3, 48)


def test_quant_linear_module_rejects_wrong_in_features():
    """``QuantLinear`` names x's shape and the rule (it used to surface torch's reshape error, after running the
    op on x re-cut into rows of the wrong inputs)."""
    from portakern.errors import InvalidInputError
    from portakern.quantize import quantize

    lin = torch_ops.QuantLinear(quantize(torch.randn(48, 64), bits=4, group_size=32), "cpu")
    for shape in ((3, 32), (2, 96), (4, 3, 16)):
        with pytest.raises(InvalidInputError, match=r"x must be \(\.\.\., 64\)"):
            lin(torch.randn(*shape))
    assert lin(torch.randn(2, 3, 64)).shape == (2, 3, 48)


def test_attention_op_window_must_be_a_pair_of_ints():
    """``attention_op(window=...)`` unpacked the window itself: ``(2,)`` or ``3`` raised a bare ``ValueError`` /
    ``TypeError`` from the unpacking; now the project's error with ``portakern.attention``'s rule. numpy ints work,
    with the values of ``portakern.attention``."""
    import portakern
    from portakern.errors import InvalidInputError

    torch.manual_seed(8)
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
    for window in ((2,), 3, (1, 0, 0), (1.5, 0), (True, 0)):
        with pytest.raises(InvalidInputError, match=r"must be a \(left, right\) pair of ints; -1 means unbounded"):
            torch_ops.attention_op(q, k, v, window=window)
    got = torch_ops.attention_op(q, k, v, window=(np.int64(2), -1))
    want = portakern.attention(q, k, v, window=(2, -1), backend="cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_empty_batch_gives_an_empty_output_on_every_device(torch_device):
    """``M = 0`` rows (an MoE expert that no token chose; dynamic shapes reach it under ``torch.compile``): the fake
    implementation says ``(0, N)`` and the CPU path returned it, but on CUDA the op built a ``QuantGemv(M=0)`` for
    the kernel and raised. Every path now returns the empty ``(0, N)`` output in x's dtype."""
    from portakern.quantize import quantize

    torch.manual_seed(9)
    w = quantize(torch.randn(256, 512, device=torch_device), bits=4, group_size=128)
    lin = torch_ops.QuantLinear(w)
    p = torch_ops.prepared(w)
    x = torch.randn(0, 512, device=torch_device, dtype=torch.float16)
    outs = [torch_ops.quant_linear(x, w), lin(x), lin(x.reshape(0, 3, 512)),
            torch.ops.portakern.quant_gemv(x, p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits, p.group_size,
                                           p.zero_point, p.N, p.K, None, p.frag)]
    for y in outs:
        assert y.dtype == torch.float16 and y.device.type == torch_device and y.shape[-1] == 256 and y.numel() == 0
    assert outs[2].shape == (0, 3, 256)


def test_a_strided_x_gives_the_same_values_as_a_contiguous_one_on_every_device(torch_device):
    """A direct ``torch.ops.portakern.quant_gemv`` call may pass an x whose K columns are not adjacent (a
    transposed view); the GPU kernels read K at unit stride, so the op copies such an x once first."""
    from portakern.quantize import quantize

    torch.manual_seed(11)
    w = quantize(torch.randn(256, 512, device=torch_device), bits=4, group_size=128)
    p = torch_ops.prepared(w)
    xt = torch.randn(512, 4, device=torch_device, dtype=torch.float16).t()      # (4, 512), strides (1, 4)
    assert xt.stride(1) != 1

    def op(x):
        return torch.ops.portakern.quant_gemv(x, p.qweight, p.scales, p.zeros, p.perm, p.kgroup, p.bits,
                                              p.group_size, p.zero_point, p.N, p.K, None, p.frag)

    torch.testing.assert_close(op(xt), op(xt.contiguous()), rtol=0, atol=0)
    assert torch_ops._unit_stride_k(xt).stride(1) == 1
    same = torch.randn(4, 512)[:, :256]                                          # row stride 512, unit K stride
    assert torch_ops._unit_stride_k(same) is same
