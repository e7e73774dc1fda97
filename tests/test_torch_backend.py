"""The ``torch`` backends (backends/torch): SDPA's kernels, flex_attention and tinygemm behind portakern's door.

Values are checked against the cpu reference backend (float64, the executable docs/ir.md) and, for the tinygemm
repack, bit for bit against the native dequantization; refusals by their reasons; ranking by ``explain``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import portakern
from portakern.arrays import to_numpy
from portakern.devices import Device
from portakern.ir import Attention, DType, QuantFormat, QuantGemv
from portakern.ir import expr as E
from portakern.plugins import registry

CPU_VARIANTS = ("torch", "torch-math", "torch-flash")
ATOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
H100 = Device("cuda", 0, "sm_90", capability=(9, 0))


def _qkv(B=2, Sq=5, Sk=9, Hq=4, Hkv=2, D=32, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, Dv or D, generator=g).to(dtype)
    return q, k, v


def _close(got, want, dtype: str, atol=None):
    g, w = got.double(), want.double()
    assert torch.equal(torch.isinf(g) & (g < 0), torch.isinf(w) & (w < 0))   # -inf LSE rows agree
    fin = torch.isfinite(w)
    err = (g[fin] - w[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= (atol or ATOL[dtype]), err


VARIANTS = {"none": {}, "causal": {"causal": True}, "window": {"window": (3, 0)},
            "alibi": {"score_mod": E.alibi_score(E.alibi_slopes(4))}, "softcap": {"softcap": 2.0},
            "prefix": {"mask_mod": E.prefix_lm_mask(2)}}


@pytest.mark.parametrize("backend", CPU_VARIANTS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_matches_the_reference(backend, variant, dtype):
    q, k, v = _qkv(dtype=getattr(torch, dtype))
    kw = dict(VARIANTS[variant], return_lse=True)
    if variant == "softcap" and backend != "torch":
        with pytest.raises(portakern.UnsupportedError, match="flex_attention"):
            portakern.attention(q, k, v, backend=backend, **kw)
        return
    out, lse = portakern.attention(q, k, v, backend=backend, **kw)
    ref, ref_lse = portakern.attention(q, k, v, backend="cpu", **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    _close(out, ref, dtype)
    _close(lse, ref_lse, "float32", atol=3e-4 if dtype == "float32" else 3e-2)


@pytest.mark.parametrize("variant", ["none", "causal", "window", "alibi", "prefix"])
def test_masks_and_score_mods_copy_nothing_from_the_host(variant, monkeypatch):
    # torch.tensor(v, device=...) is a blocking host-to-device copy on cuda (it waits for the stream, and a CUDA
    # graph cannot capture it): the backend's positions, lengths and expression constants are fills instead (the
    # SDPA path; flex_attention, which softcap takes, makes such constants itself)
    q, k, v = _qkv()
    kw = dict(VARIANTS[variant], return_lse=True)
    ref, ref_lse = portakern.attention(q, k, v, backend="cpu", **kw)
    real = torch.tensor

    def no_device_copies(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            raise AssertionError(f"torch.tensor({data!r}, device={kwargs['device']!r}) inside the torch backend")
        return real(data, *args, **kwargs)
    monkeypatch.setattr(torch, "tensor", no_device_copies)
    out, lse = portakern.attention(q, k, v, backend="torch", **kw)
    _close(out, ref, "float32")
    _close(lse, ref_lse, "float32", atol=3e-4)


@pytest.mark.parametrize("backend", CPU_VARIANTS)
def test_rows_without_a_key_are_zero_and_minus_inf(backend):
    q, k, v = _qkv(Sq=9, Sk=4)                                 # causal, Sq > Sk: the first 5 rows see no key
    out, lse = portakern.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert torch.all(out[:, :5] == 0) and torch.all(lse[:, :, :5] == -math.inf)
    ref, ref_lse = portakern.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    _close(out, ref, "float32")
    _close(lse, ref_lse, "float32", atol=3e-4)


@pytest.mark.parametrize("backend", CPU_VARIANTS)
def test_paged_varlen_and_seqlens(backend):
    q, k, v = _qkv(B=2, Sq=3, Sk=16)
    # paged: 4 pages of 4 keys per entry, shuffled, lengths 13 and 6
    kp = k.reshape(8, 4, 2, 32)[torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])]
    vp = v.reshape(8, 4, 2, 32)[torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])]
    table = torch.tensor([[1, 4, 3, 6], [0, 2, 5, 7]], dtype=torch.int32)
    lens = torch.tensor([13, 6], dtype=torch.int32)
    kw = dict(block_table=table, seqlens_k=lens, causal=True, return_lse=True)
    for got, want in zip(portakern.attention(q, kp, vp, backend=backend, **kw),
                         portakern.attention(q, kp, vp, backend="cpu", **kw)):
        _close(got, want, "float32", atol=3e-4)
    # varlen: sequences of (2, 5) and (4, 3) rows / keys
    qv, kv_, vv = torch.randn(6, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    kw = dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 5, 8], dtype=torch.int32), window=(2, 0), return_lse=True)
    got = portakern.attention(qv, kv_, vv, backend=backend, **kw)
    want = portakern.attention(qv, kv_, vv, backend="cpu", **kw)
    _close(got[0], want[0], "float32")
    _close(got[1], want[1], "float32", atol=3e-4)


def test_softcap_runs_through_flex_attention(monkeypatch):
    import torch.nn.attention.flex_attention as fx

    calls = []
    real = fx.flex_attention
    monkeypatch.setattr(fx, "flex_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v = _qkv(B=1)
    portakern.attention(q, k, v, softcap=3.0, causal=True, backend="torch")
    assert len(calls) == 1 and calls[0]["scale"] == pytest.approx(1 / math.sqrt(32))
    portakern.attention(q, k, v, causal=True, backend="torch")            # a mask alone: SDPA, not flex
    assert len(calls) == 1


def test_cpu_flash_variant_takes_its_lse_from_the_kernel(monkeypatch):
    calls = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw), raising=False)
    q, k, v = _qkv(B=1, Sq=3, Sk=3, Hq=2, Hkv=2, D=16, seed=3)   # a shape no other test compiled
    portakern.attention(q, k, v, window=(1, 0), return_lse=True, backend="torch-flash")
    assert calls


def _op(**kw):
    base = dict(batch=1, seqlen_q=128, seqlen_k=128, heads_q=8, heads_kv=8, head_dim=128, head_dim_v=128,
                dtype=DType.bfloat16, scale=0.1)
    return Attention(**{**base, **kw}).verify()


@pytest.mark.parametrize("backend, op, reason", [
    ("torch-flash", _op(dtype=DType.float32), "float16 / bfloat16"),
    ("torch-flash", _op(mask_mod=E.causal_mask()), "takes no attention mask"),
    ("torch-flash", _op(head_dim=96, head_dim_v=64), "head_dim == head_dim_v"),
    ("torch-cudnn", _op(head_dim=256, head_dim_v=256), "<= 128"),
    ("torch-cudnn", _op(dtype=DType.float16, head_dim=96, head_dim_v=96, score_mod=E.alibi_score((0.5,) * 8)),
     "rounded to float16"),
    ("torch-efficient", _op(head_dim=60, head_dim_v=60), "multiples of 8"),
    ("torch-math", _op(score_mod=E.softcap_score(5.0)), "flex_attention"),
])
def test_cuda_kernel_limits_are_refused_with_the_reason(backend, op, reason):
    s = registry().backends[backend].supports(op, H100)
    assert not s and reason in s.reason, s.reason


def test_torch_backend_takes_what_its_kernels_refuse_on_cuda():
    be = registry().backends["torch"]
    for op in (_op(dtype=DType.float32, head_dim=60, head_dim_v=60), _op(score_mod=E.softcap_score(5.0)),
               _op(score_mod=E.alibi_score((0.5,) * 8), mask_mod=E.prefix_lm_mask(3))):
        assert be.supports(op, H100), be.supports(op, H100).reason


def test_ranked_below_portakern_unless_named():
    q, k, v = _qkv()
    d = portakern.explain(portakern.attention, q, k, v)
    assert d.chosen != "torch" and "torch" in str(d) and "torch-math" in str(d)
    assert portakern.explain(portakern.attention, q, k, v, backend="torch").chosen == "torch"


# -- quantized GEMV through tinygemm ------------------------------------------------------------------------------

def _weight(N, K, G, symmetric, scale_dtype, seed=0, zeros=None):
    g = torch.Generator().manual_seed(seed)
    w = portakern.quantize(torch.randn(N, K, generator=g), bits=4, group_size=G, symmetric=symmetric,
                           scale_dtype=scale_dtype)
    t = {name: to_numpy(a) for name, a in w.tensors.items()}     # bfloat16 scales: a float32 carrier
    if zeros is not None:                    # zero points above 15 are valid (docs/ir.md) and widen the offset
        t["zeros"] = np.asarray(zeros, dtype=np.uint8).reshape(t["zeros"].shape)
    return portakern.QuantizedWeight(w.fmt, N, K, t)


@pytest.mark.parametrize("symmetric, scale_dtype", [(False, "float16"), (False, "bfloat16"), (True, "float16"),
                                                    (True, "float32")])
def test_tinygemm_repack_is_bit_exact(symmetric, scale_dtype):
    N, K, G = 40, 256, 64
    zeros = None if symmetric else np.random.default_rng(1).integers(0, 256, size=(N, K // G))
    w = _weight(N, K, G, symmetric, scale_dtype, zeros=zeros)
    eye = torch.eye(K, dtype=torch.float32)                 # out = W^T, one product per element: the dequant itself
    got = portakern.quant_gemv(eye, w, backend="torch")
    want = torch.as_tensor(np.asarray(w.dequantize(), dtype=np.float64)).T.float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype, symmetric, scale_dtype", [("float32", False, "float16"),
                                                           ("float16", False, "float16"),
                                                           ("bfloat16", True, "bfloat16"),
                                                           ("bfloat16", False, "float16")])
def test_quant_gemv_matches_the_reference(dtype, symmetric, scale_dtype):
    w = _weight(20, 128, 32, symmetric, scale_dtype)        # N = 20: padded to 32 rows inside, sliced back
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(getattr(torch, dtype))
    got = portakern.quant_gemv(x, w, backend="torch")
    want = x.double() @ torch.as_tensor(np.asarray(w.dequantize(), dtype=np.float64)).T
    assert got.dtype == x.dtype and got.shape == (3, 20)
    rel = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert (got.double() - want).abs().max() <= rel * want.abs().max()


def test_silu_mul_prologue_and_other_4bit_packings():
    g = torch.Generator().manual_seed(4)
    w = _weight(32, 64, 32, True, "float16")
    x = torch.randn(2, 128, generator=g, dtype=torch.float16)
    got = portakern.quant_gemv(x, w, prologue="silu_mul", backend="torch")
    want = portakern.quant_gemv(x, w, prologue="silu_mul", backend="cpu")
    assert (got.double() - torch.as_tensor(want).double()).abs().max() <= 1e-3 * want.abs().max()
    from gguf import GGMLQuantizationType, quantize as gguf_quantize   # GGUF Q4_0: (q - 8) * d, a zero offset
    dense = torch.randn(32, 64, generator=g).numpy()
    wq = portakern.QuantizedWeight.from_gguf(gguf_quantize(dense, GGMLQuantizationType.Q4_0),
                                             GGMLQuantizationType.Q4_0, (32, 64))
    x = torch.randn(1, 64, generator=g)
    got = portakern.quant_gemv(x, wq, backend="torch")
    want = x.double() @ torch.as_tensor(np.asarray(wq.dequantize(), dtype=np.float64)).T
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_quant_gemv_refusals_on_cpu():
    for kw, reason in ((dict(symmetric=False, scale_dtype="float32"), "do not repack exactly"),
                       (dict(symmetric=True, scale_dtype="float32", group_size=16), "group sizes"),
                       (dict(symmetric=True, bits=8), "8-bit has no torch kernel")):
        w = portakern.quantize(torch.randn(32, 128), **{"bits": 4, "group_size": 32, **kw})
        with pytest.raises(portakern.UnsupportedError, match=reason):
            portakern.quant_gemv(torch.randn(1, 128), w, backend="torch")


@pytest.mark.parametrize("dtype, fmt, reason", [
    (DType.float16, QuantFormat(4, 32, True), "bfloat16 activations"),
    (DType.bfloat16, QuantFormat(4, 32, False, scale_dtype=DType.bfloat16), "do not repack exactly"),
    (DType.bfloat16, QuantFormat(4, 32, True), "do not repack exactly"),            # float16 scales in bfloat16
    (DType.float32, QuantFormat(4, 32, False, has_g_idx=True), "g_idx"),
])
def test_quant_gemv_refusals_on_cuda(dtype, fmt, reason):
    s = registry().backends["torch"].supports(QuantGemv(1, 64, 128, dtype, fmt), H100)
    assert not s and reason in s.reason, s.reason
    ok = registry().backends["torch"].supports(QuantGemv(1, 64, 128, DType.bfloat16,
                                                         QuantFormat(4, 32, True, scale_dtype=DType.bfloat16)), H100)
    assert ok, ok.reason


def test_an_infinite_scale_that_would_not_dequantize_alike_is_an_error():
    w = _weight(16, 64, 32, False, "float16", zeros=np.full((16, 2), 5))
    t = dict(w.tensors)
    s = np.array(t["scales"], copy=True)
    s[3, 1] = np.inf                                        # (q - 8) inf + 3 inf is NaN where (q - 5) inf is -inf
    codes = np.array(t["qweight"], copy=True)
    codes[3, 16:] = 0x00                                    # k in group 1 of row 3: q = 0
    w = portakern.QuantizedWeight(w.fmt, 16, 64, {**t, "scales": s, "qweight": codes})
    with pytest.raises(portakern.BackendError, match="infinite scale"):
        portakern.quant_gemv(torch.randn(1, 64), w, backend="torch")


def test_the_vendor_benchmark_answers_help_without_a_gpu():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "vendor_backends.py"), "--help"],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("usage: "), p.stderr[-2000:]
