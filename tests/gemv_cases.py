"""Cases for the triton quantized GEMV tests (``tests/test_triton_gemv.py``) and the functions that run one.

``CASES`` run on the triton backend under Triton's CPU interpreter (``run_case``; the interpreter tier,
TRITON_INTERPRET=1); ``COMPILE_CASES`` are lowered for each target with Triton's compiler (``run_compile``). The case
lists are plain data so a test module can name its parameters without importing Triton. ``weight(case)`` builds a
checkpoint in the case's packing with the numpy reference packer.
"""

from __future__ import annotations


#: (id, packing, bits, group, symmetric, M, N, K, x dtype, extra)
CASES = [
    ("native4-asym-g128-m1-f16", "native", 4, 128, False, 1, 72, 512, "float16", {}),
    ("native4-asym-g32-m3-f32", "native", 4, 32, False, 3, 40, 256, "float32", {}),
    ("native4-sym-g64-m1-bf16", "native", 4, 64, True, 1, 48, 384, "bfloat16", {}),
    ("native4-asym-g128-m16-f16", "native", 4, 128, False, 16, 64, 512, "float16", {}),
    ("native4-asym-g128-m5-bf16-dot", "native", 4, 128, False, 5, 40, 256, "bfloat16", {}),
    ("native4-asym-g128-m20-f32", "native", 4, 128, False, 20, 24, 256, "float32", {}),
    ("native4-asym-gK-m1-f32-oddK", "native", 4, 300, False, 1, 33, 300, "float32", {}),
    ("native4-asym-g100-m2-f16-perelem", "native", 4, 100, False, 2, 16, 300, "float16", {}),
    ("native4-asym-g64-m1-f32-scalebf16", "native", 4, 64, False, 1, 32, 256, "float32", {"scale": "bfloat16"}),
    ("native4-asym-g64-m1-f16-scalef32", "native", 4, 64, False, 1, 32, 256, "float16", {"scale": "float32"}),
    ("native4-zeros-above-15-m2-f32", "native", 4, 64, False, 2, 40, 256, "float32", {"zeros_high": True}),
    ("native8-asym-g64-m1-f32", "native", 8, 64, False, 1, 40, 256, "float32", {}),
    ("native8-sym-gK-m4-f16", "native", 8, 264, True, 4, 33, 264, "float16", {}),
    ("native8-asym-g32-m16-f32", "native", 8, 32, False, 16, 32, 128, "float32", {}),
    ("awq-g32-m1-f16", "awq", 4, 32, False, 1, 64, 256, "float16", {}),
    ("awq-g128-m8-f32", "awq", 4, 128, False, 8, 32, 256, "float32", {}),
    ("gptq-g32-m1-f32", "gptq", 4, 32, False, 1, 40, 256, "float32", {}),
    ("gptq-actorder-m2-f32", "gptq", 4, 32, False, 2, 40, 256, "float32", {"g_idx": "actorder"}),
    ("gptq-actorder-m16-f16", "gptq", 4, 64, False, 16, 32, 256, "float16", {"g_idx": "actorder"}),
    ("gptq-irregular-m1-f32", "gptq", 4, 32, False, 1, 24, 256, "float32", {"g_idx": "random"}),
    ("gguf-q4_0-m1-f16", "gguf_q4_0", 4, 32, True, 1, 40, 256, "float16", {}),
    ("gguf-q4_0-m6-f32", "gguf_q4_0", 4, 32, True, 6, 16, 128, "float32", {}),
    ("gguf-q8_0-m1-f32", "gguf_q8_0", 8, 32, True, 1, 40, 256, "float32", {}),
    ("gguf-q8_0-m16-f16", "gguf_q8_0", 8, 32, True, 16, 24, 128, "float16", {}),
    # launch variants: forced split-K (workspace + arrival counters), and each dequant variant
    ("native4-splitk4-m1-f32", "native", 4, 64, False, 1, 40, 1024, "float32", {"config": ("fma", 8, 8, 4, 0)}),
    ("native4-splitk3-m16-f32-dot", "native", 4, 64, False, 16, 32, 1024, "float32", {"config": ("dot", 16, 16, 3, 2)}),
    ("native4-dq0-m1-f32", "native", 4, 128, False, 1, 24, 256, "float32", {"config": ("fma", 8, 16, 1, 0)}),
    ("native4-dq1-m2-f32", "native", 4, 128, False, 2, 24, 256, "float32", {"config": ("fma", 8, 16, 1, 1)}),
    ("native8-dq0-m1-f32", "native", 8, 64, False, 1, 24, 256, "float32", {"config": ("fma", 8, 16, 1, 0)}),
    # dq=3 (subnormal codes, not in any table yet) forced: dtypes, sym / asym, groups 32 / 128, odd K,
    # x far from 1, M=2 (the 3-D path), split-K, int8, and the paths that run it as dq=2
    *[(f"native4-dq3-{'sym' if sym else 'asym'}-g{g}-m1-{dt[:1]}{dt[-2:]}", "native", 4, g, sym, 1, 40, 512, dt,
       {"config": ("fma", 8, 16, 1, 3)})
      for dt in ("float16", "bfloat16", "float32") for sym in (False, True) for g in (32, 128)],
    ("native4-dq3-asym-gK-m1-f32-oddK296", "native", 4, 296, False, 1, 33, 296, "float32", {"config": ("fma", 8, 16, 1, 3)}),
    ("native4-dq3-asym-gK-m1-f16-oddK302-perelem", "native", 4, 302, False, 1, 17, 302, "float16",
     {"config": ("fma", 8, 16, 1, 3)}),
    ("native4-dq3-asym-g32-m1-f32-x1e6", "native", 4, 32, False, 1, 24, 256, "float32",
     {"config": ("fma", 8, 16, 1, 3), "xscale": 1e6}),
    ("native4-dq3-sym-g128-m1-f32-x1e-6", "native", 4, 128, True, 1, 24, 256, "float32",
     {"config": ("fma", 8, 16, 1, 3), "xscale": 1e-6}),
    ("native4-dq3-asym-g64-m2-bf16", "native", 4, 64, False, 2, 24, 256, "bfloat16", {"config": ("fma", 8, 16, 1, 3)}),
    ("native4-dq3-splitk4-m1-f16", "native", 4, 64, False, 1, 40, 1024, "float16", {"config": ("fma", 8, 8, 4, 3)}),
    ("native8-dq3-asym-g64-m1-f32", "native", 8, 64, False, 1, 24, 256, "float32", {"config": ("fma", 8, 16, 1, 3)}),
    ("gptq-actorder-dq3-m1-f32", "gptq", 4, 32, False, 1, 40, 256, "float32",
     {"g_idx": "actorder", "config": ("fma", 8, 16, 1, 3)}),
    ("native4-dq3-m16-f32-dot", "native", 4, 64, False, 16, 32, 256, "float32", {"config": ("dot", 16, 16, 1, 3)}),
    # the tensor-core kernel with swapped operands (6th config field: swap_ab): dtypes, M < 16, split-K,
    # act-order, int8
    ("native4-swap-g64-m16-f32", "native", 4, 64, False, 16, 48, 256, "float32", {"config": ("dot", 16, 16, 1, 2, True)}),
    ("native4-swap-g128-m5-f16", "native", 4, 128, False, 5, 40, 512, "float16", {"config": ("dot", 16, 16, 1, 2, True)}),
    ("native4-swap-sym-g32-m16-bf16", "native", 4, 32, True, 16, 32, 256, "bfloat16",
     {"config": ("dot", 32, 16, 1, 2, True)}),
    ("native4-swap-splitk3-m9-f32", "native", 4, 64, False, 9, 32, 1024, "float32", {"config": ("dot", 16, 16, 3, 2, True)}),
    ("gptq-actorder-swap-m16-f16", "gptq", 4, 64, False, 16, 32, 256, "float16",
     {"g_idx": "actorder", "config": ("dot", 16, 16, 1, 2, True)}),
    ("native8-swap-g32-m16-f32", "native", 8, 32, False, 16, 32, 128, "float32", {"config": ("dot", 16, 16, 1, 2, True)}),
    # the int4 tensor-core kernel with group-scaled MMAs (kind "mma"): dtypes, sym / asym, groups 64 / 128 /
    # 256 (K tiles of 8, 16, 32 word rows), M < 16, split-K, K not a whole number of K tiles, odd N, x far
    # from 1, and the table's own choice (no config) at M=16
    ("native4-mma-asym-g128-m16-f16", "native", 4, 128, False, 16, 64, 512, "float16", {"config": ("mma", 32, 16, 1, 2)}),
    ("native4-mma-sym-g64-m5-bf16", "native", 4, 64, True, 5, 40, 512, "bfloat16", {"config": ("mma", 16, 8, 1, 2)}),
    ("native4-mma-asym-g256-m16-f32", "native", 4, 256, False, 16, 24, 1024, "float32", {"config": ("mma", 16, 32, 1, 2)}),
    ("native4-mma-splitk3-g64-m9-f16", "native", 4, 64, False, 9, 40, 1536, "float16", {"config": ("mma", 16, 8, 3, 2)}),
    ("native4-mma-asym-g64-m16-bf16-oddK320", "native", 4, 64, False, 16, 33, 320, "bfloat16",
     {"config": ("mma", 16, 8, 1, 2)}),
    ("native4-mma-asym-g128-m4-f16-x1e-3", "native", 4, 128, False, 4, 32, 256, "float16",
     {"config": ("mma", 16, 16, 1, 2), "xscale": 1e-3}),
    ("native4-mma-asym-g128-m16-bf16-x1e6", "native", 4, 128, False, 16, 32, 256, "bfloat16",
     {"config": ("mma", 16, 16, 1, 2), "xscale": 1e6}),
    ("awq-mma-g128-m16-bf16", "awq", 4, 128, False, 16, 48, 256, "bfloat16", {"config": ("mma", 16, 16, 1, 2)}),
    ("native4-asym-g128-m16-bf16-table", "native", 4, 128, False, 16, 48, 512, "bfloat16", {}),
    # the same kernel reading x in runs (GemvConfig.x_runs; groups of 128 and more): dtypes, sym / asym,
    # groups 128 / 256, M < 16, split-K, padded word rows (K=384)
    ("native4-mma-runs-asym-g128-m16-f16", "native", 4, 128, False, 16, 64, 512, "float16",
     {"config": ("mma", 32, 16, 1, 2, {"x_runs": True})}),
    ("native4-mma-runs-sym-g128-m5-bf16", "native", 4, 128, True, 5, 40, 512, "bfloat16",
     {"config": ("mma", 16, 16, 1, 2, {"x_runs": True})}),
    ("native4-mma-runs-asym-g256-m16-f32", "native", 4, 256, False, 16, 24, 1024, "float32",
     {"config": ("mma", 16, 32, 1, 2, {"x_runs": True})}),
    ("native4-mma-runs-splitk3-g128-m9-f16", "native", 4, 128, False, 9, 40, 1536, "float16",
     {"config": ("mma", 16, 16, 3, 2, {"x_runs": True})}),
    ("native4-mma-runs-asym-g128-m16-bf16-K384", "native", 4, 128, False, 16, 33, 384, "bfloat16",
     {"config": ("mma", 16, 16, 1, 2, {"x_runs": True})}),
    # the CUDA-core kernel streamed by Triton's software pipeliner (7th config field: num_stages > 1)
    ("native4-pipe3-dq3-g128-m1-bf16", "native", 4, 128, False, 1, 40, 1024, "bfloat16",
     {"config": ("fma", 8, 16, 1, 3, False, 3)}),
    ("native4-pipe2-dq2-sym-g32-m2-f16", "native", 4, 32, True, 2, 24, 512, "float16",
     {"config": ("fma", 8, 16, 1, 2, False, 2)}),
    ("native4-pipe3-splitk3-m1-f32", "native", 4, 64, False, 1, 40, 1024, "float32",
     {"config": ("fma", 8, 8, 3, 3, False, 3)}),
    ("native4-pipe3-perelem-g100-m1-f32", "native", 4, 100, False, 1, 16, 300, "float32",
     {"config": ("fma", 8, 16, 1, 3, False, 3)}),
    ("gptq-actorder-pipe3-m1-f16", "gptq", 4, 32, False, 1, 40, 256, "float16",
     {"g_idx": "actorder", "config": ("fma", 8, 16, 1, 3, False, 3)}),
    ("native8-pipe3-g64-m1-f32", "native", 8, 64, False, 1, 24, 512, "float32", {"config": ("fma", 8, 16, 1, 3, False, 3)}),
    # words prefetched two tiles ahead (8th config field: prefetch): many tiles, split-K with short and
    # empty slices, one tile, M=2, per-element groups, int8
    ("native4-ahead2-dq3-g128-m1-bf16", "native", 4, 128, False, 1, 40, 1024, "bfloat16",
     {"config": ("fma", 8, 16, 1, 3, False, 1, 2)}),
    ("native4-ahead2-splitk3-m1-f32", "native", 4, 64, False, 1, 40, 1280, "float32",
     {"config": ("fma", 8, 8, 3, 3, False, 1, 2)}),
    ("native4-ahead2-onetile-m1-f16", "native", 4, 128, True, 1, 24, 512, "float16",
     {"config": ("fma", 8, 64, 1, 3, False, 1, 2)}),
    ("native4-ahead2-dq2-m2-f32", "native", 4, 32, False, 2, 24, 512, "float32",
     {"config": ("fma", 8, 16, 1, 2, False, 1, 2)}),
    ("native4-ahead2-perelem-g100-m1-f32", "native", 4, 100, False, 1, 16, 300, "float32",
     {"config": ("fma", 8, 8, 1, 3, False, 1, 2)}),
    ("native8-ahead2-g64-m1-f32", "native", 8, 64, False, 1, 24, 512, "float32", {"config": ("fma", 8, 16, 1, 3, False, 1, 2)}),
    # group-resident tiles (a trailing dict of GemvConfig overrides: group_rows): the x-span sum (g128,
    # several tiles, split-K), tiles capped at a group (g64: 16 -> 8 rows), tiles smaller than the
    # interleave (g32, 2 rows), act-order (x through perm), M=2, int8, symmetric, dq=2, odd K with
    # one 37-word group (no interleave), a column tile wider than the padded rows (N=100, 256 columns)
    *[(f"native4-rows-{'sym' if sym else 'asym'}-g128-m1-{dt[:1]}{dt[-2:]}", "native", 4, 128, sym, 1, 40, 1024, dt,
       {"config": ("fma", 32, 16, 3, 3, {"group_rows": True})})
      for dt in ("float16", "bfloat16", "float32") for sym in (False, True)],
    ("native4-rows-g64-capped-m1-f32", "native", 4, 64, False, 1, 24, 512, "float32",
     {"config": ("fma", 16, 16, 1, 3, {"group_rows": True})}),
    ("native4-rows-g32-bkw2-m1-f32", "native", 4, 32, False, 1, 24, 256, "float32",
     {"config": ("fma", 16, 2, 2, 3, {"group_rows": True})}),
    ("gptq4-rows-actorder-m1-f32", "gptq", 4, 32, False, 1, 24, 256, "float32",
     {"g_idx": "actorder", "config": ("fma", 16, 8, 1, 3, {"group_rows": True})}),
    ("native4-rows-g64-m2-f16", "native", 4, 64, False, 2, 24, 512, "float16",
     {"config": ("fma", 16, 8, 2, 3, {"group_rows": True})}),
    ("native8-rows-g64-m1-bf16", "native", 8, 64, False, 1, 40, 512, "bfloat16",
     {"config": ("fma", 32, 16, 2, 3, {"group_rows": True})}),
    ("native4-rows-dq2-g128-m1-f32", "native", 4, 128, False, 1, 24, 512, "float32",
     {"config": ("fma", 16, 8, 1, 2, {"group_rows": True})}),
    ("native4-rows-gK-m1-f32-oddK296", "native", 4, 296, False, 1, 33, 296, "float32",
     {"config": ("fma", 16, 8, 1, 3, {"group_rows": True})}),
    ("native4-rows-n100-bn256-m1-f32", "native", 4, 128, False, 1, 100, 256, "float32",
     {"config": ("fma", 256, 16, 1, 3, {"group_rows": True})}),
    ("native4-rows-pipe3-splitk2-m1-f32", "native", 4, 128, False, 1, 40, 1024, "float32",
     {"config": ("fma", 32, 16, 2, 3, False, 3, {"group_rows": True})}),
    # the layouts the H200 sweep times: one warp, 8 columns per thread; two warps, 4 columns, masked tile
    ("native4-rows-w1c8-g128-m1-bf16", "native", 4, 128, False, 1, 500, 1024, "bfloat16",
     {"config": ("fma", 256, 8, 4, 3, {"group_rows": True, "num_warps": 1})}),
    ("native4-rows-w2c4-g128-m1-f16-nmask", "native", 4, 128, False, 1, 300, 1024, "float16",
     {"config": ("fma", 256, 16, 2, 3, {"group_rows": True, "num_warps": 2})}),
    # the int8 table's tile for 2^24 < N*K <= 2^26: 512 columns over two warps (8 per thread),
    # 16 word rows, split K, a masked last tile
    ("native8-rows-w2c8-g128-m1-bf16-nmask", "native", 8, 128, False, 1, 700, 1024, "bfloat16",
     {"config": ("fma", 512, 16, 4, 3, {"group_rows": True, "num_warps": 2})}),
    # the silu_mul prologue (x = gate | up, input silu(gate) * up) on the CUDA-core kernel: the table's tile,
    # split K, per-word-row, group-resident and per-element-group tiles, several rows, act-order
    ("native4-silu-g128-m1-f16", "native", 4, 128, False, 1, 40, 512, "float16", {"prologue": "silu_mul"}),
    ("native4-silu-g64-m3-f32", "native", 4, 64, True, 3, 24, 256, "float32", {"prologue": "silu_mul"}),
    ("native4-silu-g100-m2-f32-perelem", "native", 4, 100, False, 2, 16, 300, "float32", {"prologue": "silu_mul"}),
    ("native8-silu-g128-m16-f16", "native", 8, 128, False, 16, 24, 256, "float16", {"prologue": "silu_mul"}),
    ("gptq-silu-actorder-m1-f32", "gptq", 4, 32, False, 1, 40, 256, "float32",
     {"prologue": "silu_mul", "g_idx": "actorder"}),
    ("native4-silu-splitk4-m1-f32", "native", 4, 64, False, 1, 40, 1024, "float32",
     {"prologue": "silu_mul", "config": ("fma", 8, 8, 4, 3)}),
    ("native4-silu-rows-g128-m1-f16", "native", 4, 128, False, 1, 300, 1024, "float16",
     {"prologue": "silu_mul", "config": ("fma", 128, 8, 2, 3, {"group_rows": True})}),
    # the sm_90 int4 table's tile below STREAM_MIN_N (the step's down projection): 64 columns x 32
    # word rows over 4 warps, K split 8 ways, a masked last column tile
    ("native4-words-bn64-kw32-s8-g128-m1-bf16-nmask", "native", 4, 128, False, 1, 200, 4096, "bfloat16",
     {"config": ("fma", 64, 32, 8, 3, {"num_warps": 4})}),
]

#: (id, M, bits, group, symmetric, packing) lowered for every target by ``compile``
COMPILE_CASES = [
    ("fma-int4-g128-m1", 1, 4, 128, False, "native"),
    ("fma-int8-sym-m2", 2, 8, 64, True, "native"),
    ("table-int4-g128-m16", 16, 4, 128, False, "native"),
    ("dot-int4-g128-m16", 16, 4, 128, False, "native", {"kind": "dot", "block_n": 128, "block_kw": 32, "num_warps": 4,
                                                        "num_stages": 2, "x_runs": False}),
    ("fma-gptq-actorder-m1", 1, 4, 128, False, "gptq-actorder"),
    ("fma-int4-g128-m1-dq3", 1, 4, 128, False, "native", {"dq": 3}),   # 7th field: config overrides
    ("dot-int4-g128-m16-swap", 16, 4, 128, False, "native", {"kind": "dot", "block_n": 128, "block_kw": 32, "num_warps": 4,
                                                             "num_stages": 2, "x_runs": False, "swap_ab": True}),
    ("mma-int4-g128-m16", 16, 4, 128, False, "native", {"kind": "mma", "block_n": 64, "block_kw": 16, "num_warps": 4,
                                                        "num_stages": 3}),
    ("mma-int4-sym-g64-m4", 4, 4, 64, True, "native", {"kind": "mma", "block_kw": 8, "num_stages": 3}),
    ("mma-int4-g128-m16-tile-x", 16, 4, 128, False, "native", {"kind": "mma", "block_n": 64, "block_kw": 16,
                                                               "num_warps": 4, "num_stages": 1, "x_runs": False}),
    # the Gluon kernel on the fragment layout (the table's choice for bf16 int4 g128+ at M = 2..16)
    ("frag-int4-g128-m4", 4, 4, 128, False, "native"),
    ("frag-int4-sym-g256-m9", 9, 4, 256, True, "native"),
    ("frag-int4-g128-m16-wide", 16, 4, 128, False, "native", {"kind": "frag", "block_n": 256, "num_warps": 4,
                                                              "split_k": 1}),
    ("fma-int4-g128-m1-pipe3", 1, 4, 128, False, "native", {"num_stages": 3}),
    ("fma-int4-g128-m1-ahead2", 1, 4, 128, False, "native", {"prefetch": 2}),
    ("fma-int4-g128-m1-rows", 1, 4, 128, False, "native", {"group_rows": True, "block_n": 256, "block_kw": 8,
                                                           "num_warps": 1, "split_k": 8}),
    ("fma-int8-g128-m1-rows", 1, 8, 128, False, "native", {"group_rows": True, "block_n": 512, "block_kw": 16,
                                                           "num_warps": 2, "split_k": 8}),
    # programmatic dependent launch: sm_90+ only (8th field: the targets)
    ("fma-int4-g128-m1-pdl", 1, 4, 128, False, "native", {"pdl": True}, ("sm_90a", "sm_100a")),
    ("fma-int4-g128-m1-ahead2-pdl", 1, 4, 128, False, "native", {"pdl": True, "prefetch": 2}, ("sm_90a",)),
    ("dot-int4-g128-m16-swap-pdl", 16, 4, 128, False, "native", {"kind": "dot", "block_kw": 32, "num_stages": 2, "x_runs": False,
                                                                 "pdl": True, "swap_ab": True}, ("sm_90a",)),
    ("mma-int4-g128-m16-pdl", 16, 4, 128, False, "native", {"kind": "mma", "block_n": 64, "block_kw": 16, "num_warps": 4,
                                                            "num_stages": 1, "pdl": True}, ("sm_90a", "sm_100a")),
    ("frag-int4-g128-m4-pdl", 4, 4, 128, False, "native", {"kind": "frag", "pdl": True}, ("sm_90a", "sm_100a")),
    ("frag-int4-sym-g128-m16-w4nt2-pdl", 16, 4, 128, True, "native", {"kind": "frag", "block_n": 128, "num_warps": 4,
                                                                      "pdl": True}, ("sm_90a",)),
]
TARGETS = ("sm_80", "sm_90a", "sm_100a")

#: forced "frag" configurations, GPU only (weights prepared on the CPU have no fragment layout): split-K,
#: 1 to 8 warps of 1 to 4 units, 8 and 16 MMA columns, symmetric, a 256-column group, N past a tile
FRAG_CASES = [
    ("native4-frag-asym-g128-m16-split4", "native", 4, 128, False, 16, 200, 1024, "bfloat16",
     {"config": ("frag", 64, 32, 4, 2)}),
    ("native4-frag-sym-g256-m3-w2nt2", "native", 4, 256, True, 3, 72, 768, "bfloat16",
     {"config": ("frag", 64, 32, 1, 2), "num_warps": 2}),
    ("awq-frag-g128-m8-w4nt4-split2", "awq", 4, 128, False, 8, 512, 512, "bfloat16",
     {"config": ("frag", 256, 32, 2, 2)}),
    ("native4-frag-asym-g128-m2-w8-split8-x1e3", "native", 4, 128, False, 2, 1100, 2048, "bfloat16",
     {"config": ("frag", 128, 32, 8, 2), "num_warps": 8, "xscale": 1e3}),
    # the table's tall entry above 8 rows (FRAG_TALL_MIN_NK): 128 rows of 4 warps x 2 units, 4 slices
    ("native4-frag-asym-g128-m16-w4nt2-split4", "native", 4, 128, False, 16, 640, 2048, "bfloat16",
     {"config": ("frag", 128, 32, 4, 2), "num_warps": 4}),
]

#: max |out - ref| / max |ref| allowed per activation dtype. fp16/bf16 round the output once
#: (2^-11, 2^-8 relative); Triton's interpreter converts fp32 -> bf16 by truncation (2^-7).
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def check_graph_replays(kern, x, prepared, out, w, tol, replays=3):
    """Capture ``kern(x, prepared, out)`` (already called once: launcher and workspace built) in a CUDA
    graph, then replay it with new x on a NaN-poisoned ``out``: every replay must match float64
    ``x @ dequant(w).T`` within ``tol`` (relative to the largest output)."""
    import numpy as np
    import torch

    from portakern.ir.packing import dequantize

    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kern(x, prepared, out)
    deq = dequantize(w.fmt, w.tensors, w.N, w.K)
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        ref = x.double().cpu().numpy() @ deq.T
        err = np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert err < tol, err


def weight(case, seed=0):
    """A ``QuantizedWeight`` with random codes, scales and zeros in the case's packing."""
    import numpy as np

    from portakern.ir import DType, Packing, QuantFormat
    from portakern.ir.packing import pack
    from portakern.quantized import QuantizedWeight

    cid, packing, bits, G, sym, M, N, K, dt, extra = case
    rng = np.random.default_rng(seed)
    gidx = extra.get("g_idx")
    fmt = QuantFormat(bits=bits, group_size=G, symmetric=sym, packing=Packing(packing),
                      scale_dtype=DType(extra.get("scale", "float16")), has_g_idx=gidx is not None)
    ng = K // G
    if packing == "gguf_q8_0":
        codes = rng.integers(-128, 128, (N, K))
    else:
        codes = rng.integers(0, 1 << bits, (N, K))
    scales = rng.uniform(0.002, 0.05, (N, ng)) * rng.choice([-1.0, 1.0], (N, ng))
    zeros = None
    if not sym:
        lo, hi = (1, 16) if packing == "gptq" else (0, (1 << bits) - 1)   # GPTQ v1 stores zero - 1
        zeros = rng.integers(lo, hi + 1, (N, ng))
    g_idx = None
    if gidx == "actorder":
        g_idx = (np.arange(K) // G)[rng.permutation(K)]
    elif gidx == "random":
        g_idx = rng.integers(0, ng, K)
    tensors = pack(fmt, codes, scales, zeros, N, K, g_idx=g_idx)
    if extra.get("zeros_high"):   # native zero points past 2^bits - 1 (pack refuses them; the layout holds uint8)
        tensors["zeros"] = rng.integers(1 << bits, 256, (N, ng)).astype(np.uint8)
    return QuantizedWeight(fmt, N, K, tensors)


def run_case(case):
    """Run one case on the triton backend (CPU interpreter); return the error figures."""
    import numpy as np
    import torch

    import portakern
    from portakern.ir.packing import dequantize

    cid, packing, bits, G, sym, M, N, K, dt, extra = case
    w = weight(case)
    rng = np.random.default_rng(1)
    prologue = extra.get("prologue")
    width = 2 * K if prologue == "silu_mul" else K
    x = torch.from_numpy(rng.standard_normal((M, width)).astype(np.float32)).to(getattr(torch, dt))
    if "xscale" in extra:   # x far from 1 (exact power-of-ten scaling is not needed: ref uses this x)
        x = (x.double() * extra["xscale"]).to(x.dtype)
    ref = reference_input(x.double().numpy(), prologue, K) @ dequantize(w.fmt, w.tensors, N, K).T
    scale = float(np.abs(ref).max()) or 1.0
    cfg = extra.get("config")
    if cfg:
        y = _run_with_config(x, w, cfg, prologue)
    else:
        with portakern.dispatch.poison_outputs():
            y = portakern.quant_gemv(x, w, prologue=prologue, backend="triton")
    y = y.double().numpy()
    cpu = portakern.quant_gemv(x, w, prologue=prologue, backend="cpu").double().numpy()
    return {"id": cid, "err": float(np.abs(y - ref).max() / scale), "err_cpu": float(np.abs(y - cpu).max() / scale),
            "nan": int(np.isnan(y).sum()), "tol": TOL[dt]}


def reference_input(x, prologue, K):
    """The GEMV's float64 input from float64 ``x``, written out here (not the cpu backend's code):
    ``silu(gate) * up = gate / (1 + exp(-gate)) * up`` for the ``silu_mul`` prologue."""
    import numpy as np

    if prologue is None:
        return x
    gate, up = x[:, :K], x[:, K:]
    with np.errstate(over="ignore"):
        return gate / (1.0 + np.exp(-gate)) * up


def _run_with_config(x, w, cfg, prologue=None):
    import torch

    from portakern.backends.triton import quant_gemv as Q
    from portakern.devices import CPU
    from portakern.gemv_weight import prepare_gemv_weight
    from portakern.validate import quant_gemv_op

    op, _ = quant_gemv_op(x, w, prologue)
    kern = Q.compile(op, CPU, forced_config(cfg, num_warps=1))
    prepared = prepare_gemv_weight(w, CPU)
    out = torch.full((op.M, op.N), float("nan"), dtype=x.dtype)
    kern(x, prepared, out)
    kern(x, prepared, out)  # twice: the split-K counters must have reset themselves
    return out


def forced_config(cfg, num_warps):
    """The ``GemvConfig`` of a case's ``(kind, bn, bkw, split, dq[, swap_ab[, num_stages[, prefetch[, pdl]]]]
    [, {field: value}])`` (a trailing dict sets other fields by name)."""
    from dataclasses import replace

    from portakern.backends.triton.quant_gemv.config import GemvConfig

    kw = cfg[-1] if isinstance(cfg[-1], dict) else {}
    kind, bn, bkw, split, dq, *more = cfg[:-1] if kw else cfg
    swap, stages, prefetch, pdl = (list(more) + [False, 1, 1, False][len(more):])[:4]
    return replace(GemvConfig(kind, bn, bkw, num_warps, stages, split, dq, swap_ab=bool(swap), prefetch=prefetch,
                              pdl=bool(pdl)), **kw)


def run_compile(case):
    """Lower one op for every target; return the target -> (kernel name, cubin bytes) map."""
    from portakern.backends.triton import quant_gemv as Q
    from portakern.ir import DType, Packing, QuantFormat
    from portakern.ir.ops import QuantGemv

    from dataclasses import replace

    from portakern.backends.triton.common.arch import arch_family, default_sms
    from portakern.backends.triton.quant_gemv import aot, config

    cid, M, bits, G, sym, packing = case[:6]
    fmt = QuantFormat(bits=bits, group_size=G, symmetric=sym, packing=Packing(packing.split("-")[0]),
                      has_g_idx=packing.endswith("actorder"))
    op = QuantGemv(M=M, N=4096, K=4096, dtype=DType.bfloat16, fmt=fmt)
    out = {}
    for t in (case[7] if len(case) > 7 else TARGETS):
        cfg = None
        if len(case) > 6:   # the target's table choice with some fields forced
            arch = arch_family(aot.TARGETS[t])
            cfg = replace(config.choose(aot.LayoutStub(op), M, op.N, arch, default_sms(arch)), **case[6])
        r = Q.compile_for_target(op, t, cfg)
        if cfg is not None:
            assert all(r["config"][k] == v for k, v in case[6].items()), r["config"]
        name, k = next(iter(r["kernels"].items()))
        out[t] = {"kernel": name, "cubin_bytes": len(k["cubin"] or b""), "kind": r["config"]["kind"], "pdl": r["config"]["pdl"],
                  "num_stages": r["config"]["num_stages"], "block_n": r["config"]["block_n"],
                  "num_warps": r["config"]["num_warps"],
                  "mma": _has_mma(k["ptx"] or ""), **_before_wait(k["ptx"] or "")}
    return {"id": cid, "targets": out}


def _before_wait(ptx: str) -> dict:
    """What the PTX does before ``griddepcontrol.wait`` (absent: waits=0): the global loads issued
    (and how many are 16-byte vectors: weight tiles) and any global store or atomic."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    head = lines[:waits[0]] if waits else []
    return {"waits": len(waits), "loads_before_wait": sum(ln.startswith("ld.global") for ln in head),
            "wide_loads_before_wait": sum(ln.startswith("ld.global.v4.b32") for ln in head),
            "writes_before_wait": sum(ln.startswith(("st.global", "atom.global", "red.global")) for ln in head)}


def _has_mma(ptx: str) -> bool:
    return "mma.sync" in ptx or "wgmma" in ptx or "tcgen05" in ptx
