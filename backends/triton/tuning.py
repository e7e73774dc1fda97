"""The triton backend's tuning tables: data only, read by ``attention/plan.py`` and ``quant_gemv/config.py``.

Each table is keyed by architecture family (``common/arch.py``: "sm_80", "sm_86", "sm_89", "sm_90", "sm_100",
"sm_120"; "interp" for Triton's CPU interpreter) and each entry names, in ``source``, the result file under
``benchmarks/results/`` that justifies it (``benchmarks/README.md`` says which command made each file, on which
device); an entry nobody measured says so and why it holds. Where a table has rows, the first row that matches
wins. The kernels' designs and what was tried against them: ``docs/design/``.
"""

# == the device families ==========================================================================================

#: Shared memory one block may use (the opt-in maximum), bytes: bounds every tile and ring depth.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
              "sm_100": 227 * 1024, "sm_120": 99 * 1024, "interp": 1 << 30}
#: Multiprocessors assumed when the device does not say (lowering for a target without the device).
DEFAULT_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_100": 148, "sm_120": 84}


# == attention =====================================================================================================

#: Multiprocessors the interpreter's runs stand for: few, so the tests' small problems split their keys.
ATTENTION_INTERP_SMS = 8

#: The ``attn_fwd`` tile of a prefill problem (one head per tile row group): ``(block_m, block_n, num_warps,
#: num_stages)`` of the first row whose family ("any": every one), dtype ("16-bit": fp16 / bf16) and bound on
#: ``max(head_dim, head_dim_v)`` match, before ``plan.fit`` cuts it to the shared memory.
PREFILL_TILES = (
    dict(family="interp", dtype="any", max_d=1 << 30, tile=(16, 16, 4, 1),
         source="none (the interpreter): small tiles, so the tests cross tile and split edges"),
    dict(family="any", dtype="float32", max_d=1 << 30, tile=(64, 32, 4, 2),
         source="none (not measured): fp32 tiles hold twice the bytes of 16-bit ones"),
    dict(family="sm_90", dtype="16-bit", max_d=128, tile=(128, 64, 8, 3),
         source="attention-prefill-sweep-h200.json (64-key tiles beat 128 by 10-20% at every D; 3-4 stages tie)"),
    dict(family="sm_90", dtype="16-bit", max_d=1 << 30, tile=(128, 64, 8, 2),
         source="attention-prefill-sweep-h200.json"),
    dict(family="sm_100", dtype="16-bit", max_d=128, tile=(128, 64, 8, 3),
         source="none (not measured): sm_90's tile, the same shared memory"),
    dict(family="sm_100", dtype="16-bit", max_d=1 << 30, tile=(128, 64, 8, 2),
         source="none (not measured): sm_90's tile, the same shared memory"),
    dict(family="sm_80", dtype="16-bit", max_d=64, tile=(128, 64, 4, 3),
         source="none (not measured): sm_90's tiles cut to sm_80's 163 KiB of shared memory"),
    dict(family="sm_80", dtype="16-bit", max_d=128, tile=(128, 64, 8, 2),
         source="none (not measured): sm_90's tiles cut to sm_80's 163 KiB of shared memory"),
    dict(family="sm_80", dtype="16-bit", max_d=1 << 30, tile=(64, 64, 4, 2),
         source="none (not measured): sm_90's tiles cut to sm_80's 163 KiB of shared memory"),
    dict(family="any", dtype="16-bit", max_d=128, tile=(64, 64, 4, 2),
         source="none (not measured): sm_86 / sm_89 / sm_120 have 99 KiB of shared memory, so smaller tiles"),
    dict(family="any", dtype="16-bit", max_d=1 << 30, tile=(64, 32, 4, 2),
         source="none (not measured): sm_86 / sm_89 / sm_120 have 99 KiB of shared memory, so smaller tiles"),
)

#: The ``attn_fwd`` tile of packed decode (the G query heads of a KV head share a tile): ``(block_n, num_warps,
#: num_stages)`` of the first row whose family, dtype, KV layout ("any", "dense", "paged") and bound on
#: ``max(head_dim, head_dim_v)`` match.
DECODE_TILES = (
    dict(family="interp", dtype="any", layout="any", max_d=1 << 30, tile=(16, 4, 1),
         source="none (the interpreter): small tiles, so the tests cross tile and split edges"),
    dict(family="any", dtype="float32", layout="any", max_d=1 << 30, tile=(32, 4, 2),
         source="none (not measured): fp32 tiles hold twice the bytes of 16-bit ones"),
    dict(family="sm_90", dtype="16-bit", layout="any", max_d=128, tile=(64, 4, 4),
         source="attention-decode-sweep-b64-h200.json (paged decode on the dense tile: pages of 16 255.8 us "
                "against 278.6 with 128-key tiles, pages of 64 250.2 against 260.2, dense 246.3; B=64, 4k keys)"),
    dict(family="sm_90", dtype="16-bit", layout="any", max_d=1 << 30, tile=(64, 4, 3),
         source="attention-decode-sweep-b64-h200.json"),
    dict(family="sm_100", dtype="16-bit", layout="paged", max_d=128, tile=(128, 4, 3),
         source="attention-decode-sweep-splits-h200.json (sm_90's earlier paged tile; sm_100 not measured)"),
    dict(family="sm_100", dtype="16-bit", layout="paged", max_d=1 << 30, tile=(64, 4, 3),
         source="attention-decode-sweep-splits-h200.json (sm_90's earlier paged tile; sm_100 not measured)"),
    dict(family="sm_100", dtype="16-bit", layout="any", max_d=128, tile=(64, 4, 4),
         source="none (not measured): sm_90's dense tile, the same shared memory"),
    dict(family="sm_100", dtype="16-bit", layout="any", max_d=1 << 30, tile=(64, 4, 3),
         source="none (not measured): sm_90's dense tile, the same shared memory"),
    dict(family="any", dtype="16-bit", layout="any", max_d=128, tile=(64, 4, 3),
         source="none (not measured): one stage fewer than sm_90's for less shared memory"),
    dict(family="any", dtype="16-bit", layout="any", max_d=1 << 30, tile=(32, 4, 2),
         source="none (not measured): half the keys for less shared memory"),
)

#: Split-KV bounds: at most MAX_SPLITS splits, each of at least MIN_TILES_PER_SPLIT key tiles (the workspace and
#: the merge grow with the splits; a split of one tile is mostly its prologue).
MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 2
#: Split the keys until the grid holds this many programs per multiprocessor.
SPLIT_PROGRAMS_PER_SM = dict(value=1, source="attention-decode-sweep-splits-h200.json (dense: 16 splits, one "
                                             "program per SM, beat 24-64 by 4-15%; paged 128-key tiles: 16 splits "
                                             "47.4 us against 53.8 for 32 at 32k keys, pages of 16)")

#: Families whose split decode merges in the last split to finish (one launch) instead of ``attn_combine``.
#: Elsewhere the separate merge: on the H200 it won at every split count (15.7 against 18.5 us at 8k keys, 16
#: splits; ``attention-decode-sweep-splits-h200.json``), since the fused merge runs one program per query tile
#: after the others finish, leaving the SMs idle.
FUSED_COMBINE = {"interp": "none (the interpreter): keeps the fused merge covered by the tests"}

#: Families whose table launches split decode (``attn_fwd`` + ``attn_combine``) as programmatic dependents; unsplit
#: launches stay normal (B=64 4k keys: 265.7 us with pdl against 258.6, ``attention-decode-sweep-pdl-h200.json``).
SPLIT_PDL = {"sm_90": "attention-decode-sweep-page64-h200.json (won or tied at every split shape by 0.1-0.9 us: "
                      "dense 8k 15.6 against 15.7 us, paged 2k 9.9 against 10.7 at 12 splits, 8k 16.4 against 16.7)"}

#: Families whose table has the Gluon decode kernel's merge release the next kernel at its start
#: (``AttnConfig.release_next``).
RELEASE_NEXT = {"sm_90": "decode-step-attention-release-h200.json (the decode step at ctx 2048: 2.296 ms against "
                         "2.314 / 2.320, the o-projection GEMV starting while the merge runs)"}

#: Families whose table launches the Gluon decode kernel's merge at the kernel's start, the merge releasing the next
#: kernel before its wait (``AttnConfig.early_merge``).
EARLY_MERGE = {"sm_90": "decode-step-attention-early-merge-h200.json (the decode step: 2.269 ms against 2.288 / "
                        "2.290 at ctx 2048, 2.527 against 2.542 / 2.547 at 8192; with the decode kernel a dependent "
                        "too 2.317 / 2.541, not adopted)"}

#: Families whose table loads ``attn_fwd``'s prefill K/V through TMA for dense fp16/bf16 with head dims above 128 in
#: whole 16-byte rows (outputs bitwise equal to the pointer kernel's).
TMA_PREFILL = {"sm_90": "attention-d256-h200.json (B=4, 4k keys, bf16: D=256 513 against 463 TFLOP/s, causal 454 "
                        "against 433; D=128 a tie, D=64 slower, 396 against 423)"}

#: Dense 16-bit prefill on the Gluon kernel (``AttnConfig.wgmma``): ``(block_n, num_stages)`` per family and head
#: dim, for at least WGMMA_MIN_SEQLEN_Q query rows (fewer leave most of a program's 128 rows idle); D=64 only
#: without a mask and from WGMMA_D64_MIN_SEQLEN_K keys (else ``attn_fwd`` stays: causal 357 against 374-383
#: TFLOP/s at 4k, 322 against 367-376 at 1k; ``attention-wgmma-tiles-h200.json``).
WGMMA_TILES = (
    dict(family="sm_90", head_dim=128, tile=(128, 2),
         source="attention-wgmma-h200.json (2 stages 654 / 518 / 613 / 611 TFLOP/s at 4k / 4k causal / 16k / 16k "
                "causal against 3 stages' 581 / 541 / 522 / 583, cuDNN 609 / 534 / 607 / 580); "
                "attention-wgmma-pingpong-h200.json (against attn_fwd's 459 / 414 / 470 / 465)"),
    dict(family="sm_90", head_dim=64, tile=(128, 2),
         source="attention-wgmma-tiles-h200.json, attention-wgmma-tiles-rerun-h200.json (no mask from 4k keys: "
                "430-462 against 411-420 TFLOP/s)"),
    dict(family="sm_90", head_dim=256, tile=(64, 2),
         source="attention-wgmma-kring-h200.json (K stages released once their scores are done: 626 / 607 / 643 / "
                "637 TFLOP/s against attn_fwd's 518 / 455 / 535 / 528, cuDNN 643 / 585 / 657 / 616; a third K "
                "stage gained nothing)"),
)
WGMMA_MIN_SEQLEN_Q = 128
WGMMA_D64_MIN_SEQLEN_K = 4096
#: Shared memory the Gluon kernels need beyond ``config.smem_bytes`` (barriers and reduction scratch: 352 bytes at
#: D=128 with 128-key tiles and 3 stages, Triton 3.6's compile report), with margin.
WGMMA_SMEM_EXTRA = 1024

#: Split paged decode of 16-bit K/V on the Gluon decode kernel (``AttnConfig.decode_ws``, one program per SM):
#: ``(block_n, num_stages)`` per family. Unsplit batches stay on ``attn_fwd`` (B=64 4k, pages of 16: 260.8 against
#: 250.3 us), and so do dense keys (a tie: 14.11 / 36.16 us).
SPLIT_PAGED_WS = {
    "sm_90": dict(tile=(64, 4), source="decode-ws-h200.json (B=1, 32/8 heads, D=128, 16 splits: pages of 16 14.83 / "
                                       "37.83 us at 8k / 32k keys against attn_fwd's 16.72 / 39.88, pages of 64 "
                                       "14.75 / 37.58 against 15.18 / 37.93; 3 stages 0.1-1.4 us slower, 32 splits "
                                       "4-5 us slower)"),
}
#: Split paged decode of 16-bit K/V on ``attn_fwd``: ``(block_n, num_stages, programs per SM)`` per family (two
#: programs per SM only where both rings fit). Dense keys keep one program per SM (36.9 against 37.3 us at 32k).
SPLIT_PAGED_TILE = {
    "sm_90": dict(tile=(64, 3, 2), source="attention-decode-sweep-h200.json (B=1, 32/8 heads, D=128: pages of 16 "
                                          "at 32 splits 16.7 / 40.3 us at 8k / 32k keys against 17.8 / 41.9 for "
                                          "128-key tiles at 16 splits); attention-decode-sweep-p16-h200.json (33 "
                                          "splits 0.45 us slower than 32 at 32k)"),
}
#: Key tile of split paged decode on ``attn_fwd`` for families without a SPLIT_PAGED_TILE entry (one program per
#: SM; taken only for pages holding whole tiles).
SPLIT_PAGED_BN = {
    "sm_100": dict(block_n=64, source="attention-decode-sweep-page64-h200.json (sm_90 then; B=1, pages of 64, 16 "
                                      "splits: 2k keys 10.1 us against 12.2 with 128-key tiles, 8k 16.4 against "
                                      "18.5; sm_100 not measured)"),
}


# == quantized GEMV ================================================================================================

#: Multiprocessors the interpreter's runs stand for: few, so the tests' small problems split K.
GEMV_INTERP_SMS = 4

#: Largest M served by the CUDA-core kernel (kind "fma"); larger M goes to a tensor-core kernel.
FMA_MAX_M = {
    "sm_80": 1, "sm_86": 1, "sm_89": 1, "sm_90": 1, "sm_100": 1, "sm_120": 1,
    "interp": 2,       # the interpreter keeps 2, so the tests cover the CUDA-core kernel's multi-row path
}
FMA_MAX_M_SOURCE = ("gemv-fma-sweep-h200.json (M=4: the CUDA-core kernel's 3-D tiles ran 2x slower than the "
                    "tensor-core one)")

#: M = 1 stays on the CUDA-core kernel: the "frag" kernel tied it within ~3% (28672x8192 37.8 against 38.7 us,
#: 4096^2 7.0 against 6.3; ``gemv-frag-sweep-h200.json``) and the CUDA-core kernel serves every format and dtype.
FRAG_MIN_M = 2

#: Kind "stream" (M = 1 int4, Gluon) from this N on, on the STREAM families: 28672x8192 36.4-37.1 against 38.7 us
#: for the group-resident "fma" entry, 16384^2 40.7-41.2 against 43.3, 6144x4096 7.8 against 8.5, 8192^2 a tie,
#: slower at N = 4096 (4096^2 7.1 against 6.3); ``gemv-stream-probe-h200.json``.
STREAM_MIN_N = 6144
STREAM = {"sm_90": "gemv-stream-probe-h200.json (measured there; the kernel lowers for sm_80 and later)"}

#: Split K until the grid holds this many programs per multiprocessor, per kernel kind (bounded by MAX_SPLIT_K).
PROGRAMS_PER_SM = {"fma": 4, "dot": 1, "mma": 3.5, "frag": 27, "stream": 2}
PROGRAMS_PER_SM_SOURCE = {
    "fma": "gemv-fma-sweep-h200.json",
    "dot": "gemv-fma-sweep-h200.json (28672x8192, M=16: 155 us unsplit against 169 with 4 slices)",
    "mma": "gemv-mma-sweep-h200.json (winners at 3.9 and 6.8 programs per SM: 28672x8192 2 slices 77.9 us "
           "against 128.8 unsplit)",
    "frag": "gemv-frag-sweep-h200.json (FRAG_PROGRAMS_PER_SM decides)",
    "stream": "gemv-stream-probe-h200.json (the stream kernel's grid is per_sm programs per SM, not split)",
}
MAX_SPLIT_K = 8
#: CUDA-core programs of more than this many warps count as several toward PROGRAMS_PER_SM["fma"]: int8 16384^2 (512
#: tiles of 32 columns, 8 warps) unsplit 69.0 us against 76.6 with two slices (``gemv-int8-sweep-h200.json``).
FMA_PROGRAM_WARPS = 4
#: Group-resident tiles (``GemvConfig.group_rows``): split K until the grid holds this many warps per
#: multiprocessor, up to MAX_SPLIT_K_ROWS slices of at least ROWS_MIN_SLICE_WORDS word rows (14336x4096 13.5 us
#: with 32-row slices against 14.0 with 16; 4096x14336 14.3 with 56 against 18.8 with 112;
#: ``gemv-rows-sweep-h200.json``).
WARPS_PER_SM_ROWS = 14
MAX_SPLIT_K_ROWS = 32
ROWS_MIN_SLICE_WORDS = 32

#: Kind "frag": K split until the grid holds FRAG_PROGRAMS_PER_SM programs per SM (by block_m: 8 or 16 rows of x;
#: with 16 the two MMAs per step make programs heavier), each slice keeping FRAG_MIN_CHUNKS 128-column chunks
#: (4096^2 at M=16: 9.7 us with 8 slices of 4 chunks, 13.4 with 16 of 2; ``gemv-frag-sweep-h200.json``).
FRAG_PROGRAMS_PER_SM = {8: 27, 16: 6.8}
FRAG_MIN_CHUNKS = {8: 2, 16: 4}
FRAG_MAX_SPLIT = 16

#: The split-K merge of kinds "frag" and "fma" (the kernels' ``MERGE``): 1, the grid's last slice adds the
#: partials (the others leave without reading the count back); 0, the last slice to arrive does. 1 up to
#: SPLIT_MERGE_MAX_NK weight elements: faster on six of eight rows by 0.37-0.92 us for "frag" and on all four
#: split rows by 0.11-0.59 us for "fma", bit-equal (``merge-ab-h100.json``); above it 0 (the M=16 28672x8192 row
#: went from 53.9 to 71.8 us with 1, ``gemv-merge-last-slice-h100.json``: the merging slices all run in the last
#: wave of a grid of several). The interpreter runs "fma" with 0 (the merging slice polls, which a
#: one-program-at-a-time run would not let finish).
SPLIT_MERGE = {"frag": 1, "fma": 1}
SPLIT_MERGE_MAX_NK = 1 << 26

#: Bounds of the table below (weight elements N * K, or columns N).
ROWS_MIN_NK = 1 << 24          # group-resident tiles at M=1 above this (4096^2: 6.5 against 6.8 us per-word-row)
ROWS_INT8_MAX_NK = 1 << 26     # int8 group-resident tiles up to this (28672x8192 64.0 us per-word-row against 67.7)
FRAG_WIDE_MIN_N = 65536        # 256-row "frag" programs from this N (the LM head)
FRAG_TALL_MIN_NK = 1 << 28     # 128-row "frag" programs above 8 rows of x from this N * K
MMA_TILE_X_MIN_NK = 1 << 27    # the "mma" kernel reads x as one tile per group from this N * K
MMA_WIDE_MIN_NK = 1 << 28      # 128-column "mma" programs from this N * K
#: Largest K tile of the "mma" kernel (word rows; a tile never leaves its group).
MMA_MAX_BKW = 32

#: The launch configuration of each kernel kind: the first row whose ``kind``, ``family`` ("any": every GPU
#: family), ``bits`` (None: any), ``rows`` (True: whole-word regular groups without act-order, what the
#: group-resident sweeps measured; None: any) and inclusive ranges of ``m``, ``n`` and ``nk`` = N * K (None:
#: unbounded) match. ``tile`` is ``(block_n, block_kw, num_warps, num_stages)``; ``pdl`` "family" launches it as
#: a programmatic dependent where the family has grid dependency control. ``quant_gemv.config.fit`` makes the
#: tile legal for the weight; the split comes from PROGRAMS_PER_SM.
GEMV_TILES = (
    dict(kind="fma", family="interp", tile=(8, 8, 1, 1),
         source="none (the interpreter): small tiles, so the tests cross tile, group and split edges"),
    dict(kind="any", family="interp", tile=(16, 16, 1, 1),
         source="none (the interpreter): small tiles, so the tests cross tile, group and split edges"),
    dict(kind="frag", n=(FRAG_WIDE_MIN_N, None), tile=(256, 32, 4, 1), pdl="family",
         source="gemv-frag-sweep-h200.json (the 128256-row head: 98.3 us against 105.3 with 64-row programs; pdl "
                "best or within noise on 10 of 12 shapes)"),
    dict(kind="frag", m=(9, None), nk=(FRAG_TALL_MIN_NK, None), tile=(128, 32, 4, 1), pdl="family",
         source="gemv-frag-sweep-h200.json (16384^2, M=16: 58.4 / 61.4 us with 4 slices against 66.2 for 64 rows)"),
    dict(kind="frag", tile=(64, 32, 2, 1), pdl="family",
         source="gemv-frag-sweep-h200.json (64-row programs won or tied at M=16 on every shape but the head)"),
    dict(kind="mma", nk=(MMA_WIDE_MIN_NK, None), tile=(128, 16, 4, 1),
         source="gemv-mma-sweep-16k-h200.json (16384^2, M=16: 86.4 us against 124 with 64 columns)"),
    dict(kind="mma", nk=(MMA_TILE_X_MIN_NK, None), tile=(64, 16, 4, 1),
         source="gemv-mma-sweep-h200.json (28672x8192: the register-split x tile without pipelining, 77.9 us "
                "against 83.8; 'dot' 155)"),
    dict(kind="mma", tile=(64, 16, 4, 3), x_runs=True,
         source="gemv-mma-sweep-h200.json (x read in runs: 4096x14336 24.3 us against 32.0, 4096^2 11.2 against "
                "13.3; 64 columns and 4 warps beat 128 and 8 everywhere)"),
    dict(kind="fma", bits=8, rows=True, m=(1, 1), nk=(ROWS_MIN_NK + 1, ROWS_INT8_MAX_NK), tile=(512, 16, 2, 1), dq=3,
         pdl="family", group_rows=True,
         source="gemv-int8-sweep-h200.json (8192^2: 22.2 us against 24.0 for the per-word-row tile)"),
    dict(kind="fma", family="sm_90", bits=4, rows=True, m=(1, 1), n=(None, STREAM_MIN_N - 1),
         nk=(ROWS_MIN_NK + 1, None), tile=(64, 32, 4, 1), dq=3, pdl="family",
         source="decode-step-down-ab-h200.json (the decode step with the down projection on this tile: 2.267-2.277 "
                "ms against 2.277-2.324 at ctx 2048; alone the two tiles tie)"),
    dict(kind="fma", bits=4, rows=True, m=(1, 1), n=(None, 8191), nk=(ROWS_MIN_NK + 1, None), tile=(256, 16, 2, 1),
         dq=3, pdl="family", group_rows=True,
         source="gemv-rows-sweep-h200.json (16 rows when N < 8192: 4096x14336 14.3 us against 15.9 with 8)"),
    dict(kind="fma", bits=4, rows=True, m=(1, 1), nk=(ROWS_MIN_NK + 1, None), tile=(256, 8, 2, 1), dq=3,
         pdl="family", group_rows=True,
         source="gemv-rows-sweep-h200.json (group-resident 8 x 256 tiles: 28672x8192 38.9 us against 43.2, "
                "16384^2 43.5 against 47.8, 128256x4096 82.8 against 91.1)"),
    dict(kind="fma", n=(16384, None), tile=(32, 64, 8, 1), dq=3, pdl="family",
         source="gemv-fma-sweep-h200.json (32 x 64-word tiles won every M=1 shape, 8 warps when N fills the chip); "
                "gemv-pdl-sweep-h200.json (pdl: 4096^2 6.4 us against 7.5, 28672x8192 39.9 against 40.7)"),
    dict(kind="fma", tile=(32, 64, 4, 1), dq=3, pdl="family",
         source="gemv-fma-sweep-h200.json (dq=3 beat dq=2 on every swept shape: 28672x8192 40.9 us against 49); "
                "gemv-pdl-sweep-h200.json"),
    dict(kind="dot", m=(5, None), tile=(128, 32, 4, 2), swap_ab=True,
         source="gemv-fma-sweep-h200.json (M=16 with swapped operands 10-16% faster: 28672x8192 155 us against "
                "171); gemv-pdl-sweep-h200.json (pdl did not help it: 175 against 155)"),
    dict(kind="dot", tile=(128, 32, 4, 2),
         source="gemv-fma-sweep-h200.json (M=4: swapped operands not faster)"),
)
