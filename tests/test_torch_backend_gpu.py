"""On a CUDA device: every torch backend (torch's choice, math, flash, memory-efficient, cuDNN) against the cpu
reference, through its own ``supports`` (a refusal is asserted to carry a reason, never skipped silently), and the
tinygemm int4 GEMV on cuda (bfloat16, symmetric bfloat16 scales) exact against the dequantized weight. Skipped without
a CUDA device (the CPU half is ``tests/test_torch_backend.py``).

    python -m pytest -q tests/test_torch_backend_gpu.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import portakern
from portakern.devices import detect_devices
from portakern.ir import expr as E

GPU = [d for d in detect_devices() if d.type == "cuda"]
DEV = f"cuda:{GPU[0].index}" if GPU else None
BACKENDS = ("torch", "torch-math", "torch-flash", "torch-efficient", "torch-cudnn")
ATOL = {"float16": 4e-3, "bfloat16": 3e-2}
VARIANTS = {"none": {}, "causal": {"causal": True}, "window": {"window": (64, 0)},
            "alibi": {"score_mod": E.alibi_score(E.alibi_slopes(8))}, "softcap": {"softcap": 20.0}}


@pytest.fixture(autouse=True)
def _need_gpu():
    if DEV is None:
        pytest.skip("no CUDA device on this machine: tests/test_torch_backend.py covers the CPU half")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype, D", [("bfloat16", 128), ("float16", 64)])
def test_each_sdpa_kernel_against_the_reference(backend, variant, dtype, D):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, S, H, D, generator=g) for S, H in ((100, 8), (300, 2), (300, 2)))
    kw = dict(VARIANTS[variant], return_lse=True)
    t = [x.to(DEV, getattr(torch, dtype)) for x in (q, k, v)]
    try:
        portakern.explain(portakern.attention, *t, backend=backend, **kw)
    except portakern.UnsupportedError as e:
        assert "kernel" in str(e) or "flex_attention" in str(e), str(e)   # a refusal names the kernel's limit
        return
    out, lse = portakern.attention(*t, backend=backend, **kw)
    ref, ref_lse = portakern.attention(*(x.to(getattr(torch, dtype)).float() for x in (q, k, v)), backend="cpu",
                                       **kw)
    assert (out.float().cpu() - ref).abs().max() <= ATOL[dtype]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(lse.cpu() == -math.inf, ref_lse == -math.inf)
    assert (lse.cpu()[fin] - ref_lse[fin]).abs().max() <= 2e-2


def test_tinygemm_on_cuda_gives_the_dequantized_weight_rounded_once():
    w = portakern.quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)), bits=4, group_size=64,
                           symmetric=True, scale_dtype="bfloat16").to(DEV)
    eye = torch.eye(256, device=DEV, dtype=torch.bfloat16)
    got = portakern.quant_gemv(eye, w, backend="torch")
    want = torch.as_tensor(np.asarray(w.to("cpu").dequantize(), dtype=np.float32)).T.to(torch.bfloat16)
    assert torch.equal(got.cpu(), want)
    x = torch.randn(4, 256, device=DEV, dtype=torch.bfloat16)
    ref = x.double().cpu() @ torch.as_tensor(np.asarray(w.to("cpu").dequantize(), dtype=np.float64)).T
    assert (portakern.quant_gemv(x, w, backend="torch").double().cpu() - ref).abs().max() <= 1.6e-2 * ref.abs().max()
