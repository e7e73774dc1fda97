"""The GEMV benchmark's peers, each a list of calls over its own input sets: tinygemm int4, bf16 ``F.linear``,
torch's int8 per-channel kernel, and gemlite where it is importable."""

from __future__ import annotations

import torch


def tinygemm(M, N, K, gs, copies):
    sets = []
    for _ in range(copies):
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
        sz = (torch.rand(K // gs, N, 2, device="cuda") * 0.01).to(torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        sets.append((x, packed, sz))
    return [(lambda s=s: torch.ops.aten._weight_int4pack_mm(s[0], s[1], gs, s[2])) for s in sets]


def bf16_linear(M, N, K, copies):
    sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
             torch.randn(N, K, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    return [(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets]


def int8_torch(M, N, K, copies):
    sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
             torch.randint(-128, 127, (N, K), dtype=torch.int8, device="cuda"),
             torch.rand(N, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    return [(lambda s=s: torch.ops.aten._weight_int8pack_mm(s[0], s[1], s[2])) for s in sets]


def gemlite_fns(M, N, K, gs, copies):
    import gemlite  # noqa: F401  (optional peer)
    from gemlite.helper import A16W4

    sets = []
    for _ in range(copies):
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
        layer = A16W4(device="cuda").from_linear(lin)
        sets.append((torch.randn(M, K, device="cuda", dtype=torch.float16), layer))
    return [(lambda s=s: s[1](s[0])) for s in sets]
