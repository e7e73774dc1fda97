"""The triton-rocm backend's launch configurations per AMD target: data only, read by ``common/plan.py``.

Tables are keyed by gfx target ("gfx90a" CDNA2, "gfx942" CDNA3 / MI300, "gfx950" CDNA4 / MI350; "interp" for
Triton's CPU interpreter). No AMD GPU was available where these were written, so nothing here was measured: every
entry's ``source`` names the public reference its figure comes from and says so. Where a table has rows, the first
row that matches wins. AMD-specific compile options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) are
Triton's HIP backend options (``triton.backends.amd.compiler.HIPOptions``); the interpreter ignores them, so the
"interp" rows carry none.
"""

# == the targets ===================================================================================================

_SPECS = ("not measured; from AMD's public 'GPU hardware specifications' table (ROCm documentation, "
          "rocm.docs.amd.com/en/latest/reference/gpu-arch-specs.html)")

#: What the plans need to know of each target: compute units (decode split sizing), LDS bytes one workgroup may
#: use (bounds tiles and pipeline depth), wavefront size (Triton's HIP backend compiles CDNA for wave64).
TARGETS = {
    "gfx90a": dict(compute_units=110, lds=64 * 1024, wave=64, source=_SPECS + " (MI250X, one die)"),
    "gfx942": dict(compute_units=304, lds=64 * 1024, wave=64, source=_SPECS + " (MI300X)"),
    "gfx950": dict(compute_units=256, lds=160 * 1024, wave=64,
                   source=_SPECS + " (MI355X; LDS 160 KB per CU, AMD CDNA 4 architecture whitepaper)"),
    "interp": dict(compute_units=8, lds=1 << 30, wave=64,
                   source="none (the interpreter): 8 units, so the tests' small problems split their keys"),
}

#: The targets ``compile_for_target`` lowers for (CI lowers every supported case for each).
COMPILE_TARGETS = ("gfx942", "gfx950")

#: ``tl.dot``'s input precision for float32 operands: Triton's HIP backend allows "tf32" (xf32) on gfx942 only and
#: refuses it elsewhere; "ieee" everywhere keeps fp32 attention exact-ish and one code path.
DOT_PRECISION = dict(value="ieee", source="not measured; triton/backends/amd/compiler.py allows tf32 on gfx942 only")

# == attention =====================================================================================================

_FA_TUTORIAL = ("not measured; from the ROCm Triton flash-attention configurations (ROCm/triton "
                "python/perf-kernels/flash-attention.py autotune list and ROCm's 'Optimizing Triton kernels' "
                "guide: BLOCK_M 128, BLOCK_N 64, 4 warps, waves_per_eu 2, matrix_instr_nonkdim 16 on MI300)")

#: The ``attn_fwd`` tile of a prefill problem: ``block_m, block_n, num_warps, num_stages`` and the HIP options, for
#: the first row whose target ("any": every one), dtype class ("16-bit" or "float32") and bound on
#: ``max(head_dim, head_dim_v)`` match; ``plan.fit`` then cuts it to the target's LDS.
PREFILL_TILES = (
    dict(target="interp", dtype="any", max_d=1 << 30, tile=(16, 16, 4, 1), hip={},
         source="none (the interpreter): small tiles, so the tests cross tile and split edges"),
    dict(target="any", dtype="float32", max_d=1 << 30, tile=(64, 32, 4, 1),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
         source="not measured; fp32 tiles hold twice the bytes of 16-bit ones (the 16-bit row halved)"),
    dict(target="gfx950", dtype="16-bit", max_d=128, tile=(128, 64, 4, 2),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
         source=_FA_TUTORIAL + "; 2 stages: gfx950's 160 KB LDS holds the ring (kpack is 1 from gfx950 on)"),
    dict(target="any", dtype="16-bit", max_d=128, tile=(128, 64, 4, 1),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1), source=_FA_TUTORIAL),
    dict(target="any", dtype="16-bit", max_d=1 << 30, tile=(64, 32, 4, 1),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
         source="not measured; head dims over 128: the 128-dim tile halved to fit 64 KB of LDS"),
)

#: The ``attn_fwd`` tile of packed decode (the G query heads of a KV head share a tile): ``block_n, num_warps,
#: num_stages`` and the HIP options.
DECODE_TILES = (
    dict(target="interp", dtype="any", max_d=1 << 30, tile=(16, 4, 1), hip={},
         source="none (the interpreter): small tiles, so the tests cross tile and split edges"),
    dict(target="any", dtype="float32", max_d=1 << 30, tile=(32, 4, 1),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
         source="not measured; fp32 tiles hold twice the bytes of 16-bit ones"),
    dict(target="any", dtype="16-bit", max_d=1 << 30, tile=(64, 4, 1),
         hip=dict(waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
         source="not measured; from the ROCm Triton decode attention (ROCm/triton python/perf-kernels "
                "decode_attention: BLOCK_N 64, 4 warps, one stage)"),
)

#: Split-KV decode: split until the grid holds this many programs per compute unit, at most MAX_SPLITS splits of
#: at least MIN_TILES_PER_SPLIT key tiles each. The splits always merge in the separate ``attn_combine`` launch
#: (no programmatic dependent launch on AMD; the fused merge's spin on arrival counters is not chosen).
SPLIT_PROGRAMS_PER_CU = dict(value=2, source="not measured; two programs per CU (waves_per_eu 2 above)")
MAX_SPLITS = 32
MIN_TILES_PER_SPLIT = 2

# == quantized GEMV ================================================================================================

#: Largest M served by the CUDA-core-style kernel (kind "fma": FMAs on the vector ALUs); larger M goes to the
#: ``tl.dot`` kernel (kind "dot", MFMA on CDNA). The interpreter keeps 2, so the tests cover both paths.
FMA_MAX_M = {"gfx90a": 1, "gfx942": 1, "gfx950": 1, "interp": 2}
FMA_MAX_M_SOURCE = "not measured; the triton backend's choice on NVIDIA (M=1 on vector units, M>1 on matrix units)"

#: Split K until the grid holds this many programs per compute unit (at most MAX_SPLIT_K slices of at least two
#: K tiles each).
PROGRAMS_PER_CU = dict(fma=4, dot=1, source="not measured; the triton backend's NVIDIA figures per SM, per CU here")
MAX_SPLIT_K = 8

#: The launch configuration of each kernel kind: the first row whose ``kind`` and ``target`` ("any": every gfx
#: target, never the interpreter) match. ``tile`` is ``(block_n, block_kw, num_warps, num_stages)``; ``hip`` the
#: HIP compile options; ``dq`` the dequantization variant of ``kernels.gemv_common._codes`` (2: exact fp32 codes
#: by the 2^23 mantissa trick; 3 reads codes as fp32 subnormals, which this table does not rely on for AMD).
GEMV_TILES = (
    dict(kind="fma", target="interp", tile=(8, 8, 1, 1), dq=2, hip={},
         source="none (the interpreter): small tiles, so the tests cross tile, group and split edges"),
    dict(kind="dot", target="interp", tile=(16, 16, 1, 1), dq=2, hip={},
         source="none (the interpreter): small tiles, so the tests cross tile, group and split edges"),
    dict(kind="fma", target="any", tile=(64, 16, 4, 1), dq=2, hip=dict(waves_per_eu=0),
         source="not measured; memory-bound GEMV: 64 columns x 16 words per program, 4 waves of 64 lanes"),
    dict(kind="dot", target="any", tile=(64, 16, 4, 2), dq=2,
         hip=dict(waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
         source="not measured; 16x16 MFMA tiles (matrix_instr_nonkdim 16, ROCm 'Optimizing Triton kernels' "
                "guide), 2 stages: the HIP stream pipeliner's default"),
)

#: Multiprocessors the interpreter's GEMV runs stand for: few, so the tests' small problems split K.
GEMV_INTERP_CUS = 4
