#!/usr/bin/env bash
# Run named GPU steps one after another on a CUDA machine, logging each, results under $RES.
#
#   RES=/tmp/pk bash benchmarks/run_gpu.sh conformance gemv-tests gemv-sweep decode-sweep
#
# Steps (each one's output goes to $RES/<step>.log; a failing step does not stop the others):
#   install         pip install -e . without dependencies (the machine has torch and Triton)
#   conformance     triton on cuda:0, gpu tier (which includes every cpu-tier case), all cores;
#                   $CASES (comma-separated globs) restricts it to some cases
#   gemv-tests      the GPU tests of the quantized GEMV (every packing, forced configs, graphs, stream-K)
#   attention-tests the GPU tests of the attention kernels (split decode replayed in a CUDA graph, TMA,
#                   the Gluon prefill and decode kernels)
#   cuda-tests      tests/test_cuda_backend.py: the cuda backend's GPU value and graph tests with the rest of the file
#   cuda-conformance  the cuda backend on cuda:0, gpu tier (its M = 1 GEMV cases; the rest unsupported)
#   gemv-table-sweep  benchmarks/gemv_table_sweep.py: the cuda backend's GEMV kernel (CUDA C, NVRTC) at M = 1 over
#                   its launch variants (deep rings on N <= 6144), each against float64, then timed beside the triton
#                   table and tinygemm (afterwards: gemv_table_sweep.py --phase write-table --from <its JSON> writes
#                   backends/cuda/tuning.py)
#   gemv-table-sweep-deep  the same sweep on the shapes of more than 6144 columns with the deep rings (PF 4 / 8) too
#                   (--deep-max-n 1000000): for a card whose bandwidth wants more bytes in flight per SM
#   gemv-table-sweep-m4  the same at M = 4 on the int4 table's six shapes
#   decode-step-backends  the step at ctx 2048 and 8192 (three captures, peers in the same run) with each GEMV on the
#                   backend torch.ops.portakern.quant_gemv picks, and again with every GEMV forced onto triton
#   gemv-sweep      benchmarks/gemv.py --sweep over dq 2/3 and both operand orders, M 1 4 16
#   gemv-bench      benchmarks/gemv.py with the tables (no sweep)
#   gemv-rows-sweep benchmarks/gemv.py --sweep at M=1 over both tile families (group_rows 0/1), the
#                   six bench shapes and the decode step's (6144x4096, 28672x4096, 128256x4096)
#   gemv-int8-sweep benchmarks/gemv.py --sweep at M=1 int8 over both tile families (group_rows 0/1) on the
#                   three int8 table shapes, then the int8 table rows with the winners (torch int8 peer)
#   gemv-frag-sweep benchmarks/gemv.py --sweep at M 4 and 16 over the fragment-layout kernel ("frag": 64/128
#                   rows, half/auto/twice the split) with and without pdl on the six bench shapes, then those
#                   table rows with the winners beside tinygemm
#   gemv-mma-sweep  benchmarks/gemv.py --sweep at M 4 and 16 over the group-scaled tensor-core kernel
#                   (kind "mma"), then the main table with the winners
#   gemv-mma-m1-sweep  the same kernel at M=1 (pdl) against both CUDA-core tile families, three shapes
#   decode-sweep    benchmarks/attention.py --sweep --bench --decode-only
#   decode-bench    benchmarks/attention.py --bench --decode-only (the tables)
#   attention-bench benchmarks/attention.py --bench (prefill and decode, tables)
#   prefill-sweep   benchmarks/attention.py --sweep --bench --prefill-only ($HEAD_DIMS: the head dims,
#                   default 64 128 256)
#   decode-step     benchmarks/decode_step.py --breakdown (Llama-3-8B-shaped step in one CUDA graph; its
#                   GEMVs, attention and glue each timed alone too; the same step with glue kernels that are
#                   not programmatic dependents, and their logits compared)
#   decode-step-attention  the step at ctx 2048 and 8192 with its paged attention's launches changed (the merge not
#                   releasing the o-projection GEMV early; and the decode kernel as a dependent): --compare-attention
#                   $ATTENTION_VARIANTS (default hold release-pdl table), no peers
#   decode-step-gemv-sweep  the step at ctx 2048 with the o and the down GEMV (one process each) under every
#                   configuration the autotuner would time for its shape (--sweep-gemv, graph only, no peers)
#   decode-step-fused-silu  the step at ctx 2048 and 8192 with the down GEMV reading gate/up through the silu_mul
#                   prologue (no SiLU-mul glue kernel), alternating with the table's step (--fused-silu), no peers
#   decode-step-tiles  the step at ctx 2048 with the table and with the per-word-row GEMV tile
#                   everywhere (--compare-tiles, no peers)
#   vendor-bench    benchmarks/vendor_backends.py: every GPU backend (ours and the vendors') per shape, eager and in a
#                   CUDA graph, and auto's choice; backends failing a case in vendor-conformance's reports of this
#                   card (run that step first) are marked uncertified
#   vendor-conformance  the vendor backends on cuda:0, gpu tier, one report per backend ($VENDORS, default torch fa4
#                   flashinfer; $CASES restricts the cases); fa4 / flashinfer need their packages
#   dispatch        benchmarks/dispatch_overhead.py
#   transformers-tests  tests/test_integration_transformers.py (tiny models against eager attention on cuda too, the
#                   decode step compiled with CUDA graphs; needs transformers: pip install transformers)
#   e2e-decode      benchmarks/e2e_decode.py --quick: a Llama-3-8B-shaped transformers model, int4 linears and attention
#                   on portakern, generate (static cache, CUDA graphs) and a plain loop over the compiled step, beside
#                   bf16 SDPA and torchao int4 ($E2E_ARGS replaces --quick, e.g. "--layers 8" for every mode)
#   gemv-memory     benchmarks/gemv_memory.py: resident bytes per parameter and quantize + prepare time of int4 g128
#                   Llama-3-8B-shaped linears per prepared layout (words+fragments, fragments) against torchao, and
#                   quant_gemv of both layouts at M 1 and 16; then the GPU tests of weight preparation and capture
#   launch-tests    the GPU tests of KernelLaunch's fast path (GEMV kernels and the paged decode kernel called again
#                   on new tensors, graph replays)
#   ncu             Nsight Compute stall/throughput sections of benchmarks/profile_kernels.py
#                   ($PROFILE_ONLY=mma: the tensor-core GEMV kernels instead)
# $PK_COMMIT names the commit in the results (the device copy has no git history); $TAG is what a run varies, added to
# the result names (e.g. -deep; names are <benchmark><TAG>-<card>.json, the date and commit live inside);
# $STEP_TIMEOUT bounds each step (seconds, default 540); $GEMV_K narrows gemv-tests (pytest -k, default gpu).
set -u
RES=${RES:-/tmp/pk}
TAG=${TAG:-}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
cd "$(dirname "$0")/.."

step() {
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$RES/steps.txt"
    timeout "${STEP_TIMEOUT:-540}" "$@" >"$RES/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$RES/steps.txt"
    tail -n 25 "$RES/$name.log"
}

# the card in report names: h100, h200, ... (from nvidia-smi; "gpu" where it cannot say)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -o -i -E '[A-Z][0-9]{3}' | head -n 1 | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}

for s in "$@"; do
    case $s in
        install) step install python3 -m pip install -q --no-deps --no-build-isolation -e . ;;
        conformance) step conformance python3 -m portakern conformance --backend triton --device cuda:0 \
            --tier gpu --jobs 0 --no-progress ${CASES:+--cases "$CASES"} --report "$RES/triton-$CARD-gpu$TAG.json" \
            --markdown "$RES/triton-$CARD-gpu$TAG.md" ;;
        gemv-tests) step gemv-tests python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py \
            tests/test_triton_gemv_stream.py -k "${GEMV_K:-gpu}" ;;
        attention-tests) step attention-tests python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
            tests/test_triton_attention_tma.py tests/test_triton_attention_wgmma.py \
            tests/test_triton_attention_decode_ws.py -k gpu ;;
        cuda-tests) step cuda-tests python3 -m pytest -q -p no:cacheprovider tests/test_cuda_backend.py ;;
        cuda-conformance) step cuda-conformance python3 -m portakern conformance --backend cuda --device cuda:0 \
            --tier gpu --jobs 0 --no-progress --report "$RES/cuda-$CARD-gpu$TAG.json" \
            --markdown "$RES/cuda-$CARD-gpu$TAG.md" ;;
        gemv-table-sweep) step gemv-table-sweep python3 benchmarks/gemv_table_sweep.py --phase bench --tag="$TAG" \
            --out "$RES" ;;
        gemv-table-sweep-deep) step gemv-table-sweep-deep python3 benchmarks/gemv_table_sweep.py --phase bench \
            --deep-max-n 1000000 --shapes 4x14336x4096 4x8192x8192 4x28672x8192 4x16384x16384 4x28672x4096 \
            4x128256x4096 8x8192x8192 8x28672x8192 8x16384x16384 --tag="-deep$TAG" --out "$RES" ;;
        gemv-table-sweep-m4) step gemv-table-sweep-m4 python3 benchmarks/gemv_table_sweep.py --phase bench --m 4 \
            --tag="$TAG" --out "$RES" ;;
        decode-step-backends) step decode-step-backends python3 benchmarks/decode_step.py --ctx 2048 8192 --captures 3 \
            --compare-gemv-backend triton --tag="-backends$TAG" --out "$RES" ;;
        gemv-sweep) step gemv-sweep python3 benchmarks/gemv.py --sweep --ms 1 4 16 --dq 2 3 --swap both \
            --tag="$TAG" --out "$RES" ;;
        gemv-bench) step gemv-bench python3 benchmarks/gemv.py --tag="$TAG" --out "$RES" ;;
        gemv-rows-sweep) step gemv-rows-sweep python3 benchmarks/gemv.py --sweep --ms 1 --dq 3 --pdl 1 \
            --group-rows 0 1 --no-table --sweep-shapes 4096x4096 6144x4096 14336x4096 4096x14336 8192x8192 \
            28672x4096 28672x8192 16384x16384 128256x4096 --tag="-rows-sweep$TAG" --out "$RES" ;;
        gemv-int8-sweep) step gemv-int8-sweep python3 benchmarks/gemv.py --sweep --sweep-bits 8 --dq 3 --pdl 1 \
            --group-rows 0 1 --table-bits 8 --sweep-shapes 8192x8192 28672x8192 16384x16384 \
            --tag="-int8-sweep$TAG" --out "$RES" ;;
        gemv-frag-sweep) step gemv-frag-sweep python3 benchmarks/gemv.py --sweep --ms 4 16 --swap none --frag 1 \
            --pdl 0 1 --table-bits 4 --sweep-shapes 4096x4096 14336x4096 4096x14336 8192x8192 28672x8192 16384x16384 \
            --tag="-frag-sweep$TAG" --out "$RES" ;;
        gemv-mma-sweep) step gemv-mma-sweep python3 benchmarks/gemv.py --sweep --ms 4 16 --swap none --mma 1 \
            --mma-bn 64 128 --mma-warps 4 --mma-stages 1 3 \
            --sweep-shapes 4096x4096 4096x14336 28672x8192 16384x16384 --tag="-mma-sweep$TAG" --out "$RES" ;;
        gemv-mma-m1-sweep) step gemv-mma-m1-sweep python3 benchmarks/gemv.py --sweep --ms 1 --dq 3 --pdl 1 \
            --group-rows 1 --mma 1 --no-table --sweep-shapes 4096x4096 6144x4096 28672x8192 \
            --tag="-mma-m1-sweep$TAG" --out "$RES" ;;
        decode-sweep) step decode-sweep python3 benchmarks/attention.py --sweep --bench --decode-only \
            --tag="-decode-sweep$TAG" --out "$RES" ;;
        decode-bench) step decode-bench python3 benchmarks/attention.py --bench --decode-only \
            --tag="-decode$TAG" --out "$RES" ;;
        prefill-sweep) step prefill-sweep python3 benchmarks/attention.py --sweep --bench --prefill-only \
            --head-dims ${HEAD_DIMS:-64 128 256} --tag="-prefill$TAG" --out "$RES" ;;
        attention-bench) step attention-bench python3 benchmarks/attention.py --bench --tag="$TAG" --out "$RES" ;;
        decode-step) step decode-step python3 benchmarks/decode_step.py --breakdown --captures 5 --compare-glue compile-combo \
            --tag="$TAG" --out "$RES" ;;
        decode-step-attention) step decode-step-attention python3 benchmarks/decode_step.py --ctx 2048 8192 --no-peers \
            --compare-attention ${ATTENTION_VARIANTS:-hold release-pdl table} --tag="-attention$TAG" --out "$RES" ;;
        decode-step-gemv-sweep) for l in o down; do step "decode-step-sweep-$l" python3 benchmarks/decode_step.py \
            --ctx 2048 --no-peers --no-eager --sweep-gemv "$l" --sweep-limit 64 --tag="-sweep-$l$TAG" --out "$RES"; done ;;
        decode-step-fused-silu) step decode-step-fused-silu python3 benchmarks/decode_step.py --ctx 2048 8192 \
            --no-peers --no-eager --fused-silu --ab-rounds 4 --tag="-fused-silu$TAG" --out "$RES" ;;
        decode-step-tiles) step decode-step-tiles python3 benchmarks/decode_step.py --ctx 2048 --no-peers \
            --compare-tiles --tag="-tiles$TAG" --out "$RES" ;;
        dispatch) step dispatch python3 benchmarks/dispatch_overhead.py --tag="$TAG" --out "$RES" ;;
        vendor-bench) certs=$(ls "$RES"/{torch,fa4,flashinfer}-"$CARD"-gpu"$TAG".json 2>/dev/null)   # run vendor-conformance first
            step vendor-bench python3 benchmarks/vendor_backends.py --tag="$TAG" --out "$RES" \
            ${certs:+--certified-by $certs} ;;
        vendor-conformance) for b in ${VENDORS:-torch fa4 flashinfer}; do step "conformance-$b" python3 -m portakern \
            conformance --backend "$b" --device cuda:0 --tier gpu --jobs 0 --no-progress ${CASES:+--cases "$CASES"} \
            --report "$RES/$b-$CARD-gpu$TAG.json" --markdown "$RES/$b-$CARD-gpu$TAG.md"; done ;;
        transformers-tests) step transformers-tests python3 -m pytest -q -p no:cacheprovider \
            tests/test_integration_transformers.py ;;
        e2e-decode) step e2e-decode python3 benchmarks/e2e_decode.py ${E2E_ARGS:---quick} --tag="$TAG" --out "$RES" ;;
        gemv-memory) step gemv-memory python3 benchmarks/gemv_memory.py --out "$RES"
            step gemv-memory-tests python3 -m pytest -q -p no:cacheprovider tests/test_gemv_prepare_gpu.py ;;
        launch-tests) step launch-tests python3 -m pytest -q -p no:cacheprovider tests/test_triton_launch.py \
            tests/test_triton_attention_decode_ws.py tests/test_triton_gemv.py -k "launch or called_again or replays" ;;
        ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
            step ncu "${NCU:-ncu}" --profile-from-start off --clock-control none --section SpeedOfLight \
                --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
                --section LaunchStats --section Occupancy --section SourceCounters --section InstructionStats \
                --section ComputeWorkloadAnalysis python3 benchmarks/profile_kernels.py ${PROFILE_ONLY:+--only "$PROFILE_ONLY"} ;;
        *) echo "unknown step $s (see the header of $0)"; exit 2 ;;
    esac
done
echo "== done" | tee -a "$RES/steps.txt"
