"""On a CUDA device: a fresh weight's first call inside ``torch.cuda.graph`` capture (refused with ``CaptureError``
before anything invalid is recorded; after ``portakern.prepare`` it is captured and replays), preparation and
quantization on the device (the same bits as the numpy reference), resident bytes after ``prepare``, and the
fragments-only layout at M = 1 and 16 against float64. Skipped without a CUDA device (the CPU half, with capture
simulated, is ``tests/test_gemv_prepare.py``).

    python -m pytest -q tests/test_gemv_prepare_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import portakern
from portakern.devices import detect_devices
from portakern.gemv_weight import GEMV_LAYOUT, prepare_gemv_weight

GPU = [d for d in detect_devices() if d.type == "cuda"]
gpu_param = pytest.mark.parametrize("dev", GPU[:1] or [None], ids=[str(d) for d in GPU[:1]] or ["no-cuda-device"])


def _need(dev):
    if dev is None:
        pytest.skip("no CUDA device on this machine: tests/test_gemv_prepare.py covers this with capture simulated")


def _weight(N, K, seed, device="cuda", bits=4):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(N, K, generator=g, dtype=torch.float32).to(device)
    return portakern.quantize(w, bits=bits, group_size=128)


def _reference(x, w):
    return x.double() @ torch.as_tensor(w.dequantize()).double().to(x.device).T


@gpu_param
def test_gpu_fresh_weight_inside_capture_raises_then_captures_after_prepare(dev):
    _need(dev)
    portakern.quant_gemv(torch.randn(1, 256, device="cuda", dtype=torch.bfloat16), _weight(128, 256, 9))
    torch.cuda.synchronize()                         # the process's lazy start-up, outside any capture
    N, K = 4096, 1408                                # a shape no other test plans
    w = _weight(N, K, 1)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(portakern.CaptureError) as e:
        with torch.cuda.graph(graph, stream=stream):
            portakern.quant_gemv(x, w)
    msg = str(e.value)
    assert f"weight (N, K)=({N}, {K}) native int4 group_size=128" in msg and "portakern.prepare" in msg
    assert not w.prepared                            # nothing half-built was cached
    # prepared ahead: the first call of this shape is captured (plan and kernel built inside the capture)
    portakern.prepare(w, "cuda")
    assert w.native_released
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = portakern.quant_gemv(x, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(x, w)
        assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@gpu_param
def test_gpu_torch_op_inside_capture_raises_for_an_unprepared_weight(dev):
    _need(dev)
    from portakern.torch_ops import quant_linear

    w = _weight(1024, 1536, 2)
    x = torch.randn(2, 1536, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(portakern.CaptureError, match="is not prepared for cuda:0"):
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            quant_linear(x, w)


@gpu_param
@pytest.mark.parametrize("packing", ["native4", "native8", "awq", "gptq-actorder", "gguf-q8_0"])
def test_gpu_device_preparation_matches_the_host_reference(dev, packing):
    _need(dev)
    from gemv_cases import CASES, weight

    pick = {"native4": "native4-asym-g128-m1-f16", "native8": "native8-asym-g64-m1-f32", "awq": "awq-g32-m1-f16",
            "gptq-actorder": "gptq-actorder-m2-f32", "gguf-q8_0": "gguf-q8_0-m1-f32"}[packing]
    w = weight(next(c for c in CASES if c[0] == pick))
    host = prepare_gemv_weight(w, dev)                                          # numpy, uploaded
    wd = w.with_tensors({k: torch.as_tensor(np.ascontiguousarray(v)).cuda() for k, v in w.tensors.items()})
    got = prepare_gemv_weight(wd, dev)                                          # torch ops on the GPU
    for name in ("qweight", "scales", "zeros", "perm", "kgroup", "frag"):
        a, b = getattr(host, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert b.is_cuda and torch.equal(a, b), name


@gpu_param
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_gpu_quantize_stays_on_the_device_and_matches_the_reference(dev, scale_dtype):
    _need(dev)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    q = portakern.quantize(w, bits=4, group_size=128, scale_dtype=scale_dtype)
    ref = portakern.quantize(w.cpu(), bits=4, group_size=128, scale_dtype=scale_dtype)
    assert all(t.is_cuda for t in q.tensors.values())
    for name, t in ref.tensors.items():
        assert torch.equal(q.tensors[name].cpu(), t), name


@gpu_param
@pytest.mark.parametrize("layout", ["words+fragments", "fragments"])
def test_gpu_resident_bytes_after_prepare(dev, layout):
    _need(dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    w = _weight(4096, 4096, 3)
    native = (torch.cuda.memory_allocated() - base) / 4096 ** 2
    portakern.prepare(w, "cuda", layout=layout)
    torch.cuda.synchronize()
    resident = (torch.cuda.memory_allocated() - base) / 4096 ** 2
    # codes 0.5 bytes a parameter, fp16 scales and zeros 4 bytes per group of 128: 0.53 (words as well: 1.03)
    assert 0.52 <= native <= 0.54 and w.native_released
    assert resident <= (0.54 if layout == "fragments" else 1.04), resident
    assert abs(resident - w.prepared_nbytes / 4096 ** 2) < 0.01    # the prepared copy is all that is left
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    for M in (1, 16):
        y = portakern.quant_gemv(x[:M], w)
        ref = _reference(x[:M], w)
        assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()), M


@gpu_param
def test_gpu_quant_linear_fragments_only_is_captured_and_saved(dev):
    _need(dev)
    from portakern.torch_ops import QuantLinear

    w = _weight(2048, 2048, 4)
    lin = QuantLinear(w, "cuda", layout="fragments")
    assert lin.qweight is None and lin.frag is not None and "frag" in lin.state_dict()
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    y0 = lin(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        y = lin(x)
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(x, w)
    tol = 2e-2 * ref.abs().max().item()
    assert torch.allclose(y.double(), ref, rtol=2e-2, atol=tol)
    assert torch.allclose(y0.double(), ref, rtol=2e-2, atol=tol)
