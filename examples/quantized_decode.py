"""End to end: quantize a weight, run batch-1..16 decode GEMVs, load a GGUF Q4_0 tensor.

    python examples/quantized_decode.py
"""

import numpy as np
import torch

import portakern


def main():
    rng = np.random.default_rng(0)
    N, K = 256, 512
    w = rng.standard_normal((N, K)).astype(np.float32)

    # 1. portakern's own packing: 4-bit, one scale and zero point per 128 weights along K
    w4 = portakern.quantize(w, bits=4, group_size=128)
    print(w4)
    dense = np.asarray(w4.dequantize(), dtype=np.float64)
    for M in (1, 4, 16):
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = portakern.quant_gemv(x, w4)                      # x @ dequant(W)^T, (M, N)
        err = np.abs(y - x.astype(np.float64) @ dense.T).max()
        print(f"M={M:2d}  y {y.dtype} {y.shape}  max|err| vs dequantized matmul {err:.1e}")
        assert err < 1e-3

    # 2. the caller's array type and dtype come back: fp16 torch in, fp16 torch out
    y = portakern.quant_gemv(torch.from_numpy(x).half(), w4)
    print(f"torch fp16 in -> {y.dtype} {tuple(y.shape)} out")

    # 3. weights from a llama.cpp file: GGUF Q4_0 blocks as the gguf package writes them
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        print("gguf not installed: skipping the GGUF part (pip install gguf)")
    else:
        blocks = quants.quantize(w, GGMLQuantizationType.Q4_0)
        wq = portakern.QuantizedWeight.from_gguf(blocks, "Q4_0", (N, K))
        y = portakern.quant_gemv(x, wq)
        ref = x.astype(np.float64) @ quants.dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float64).T
        print(f"GGUF Q4_0: {wq}  max|err| vs gguf.dequantize {np.abs(y - ref).max():.1e}")

    print()
    print(portakern.explain(portakern.quant_gemv, x, w4))


if __name__ == "__main__":
    main()
