#!/usr/bin/env bash
# One device call: kernel parity at real shapes, GPU correctness, W1, W2 128/128, W3, kernels.
# Usage on the GPU host (from the repo root): bash perf/run_gpu.sh [stages...]
# Logs go to $OUT (or perf/logs); every stage has its own time limit so one failure or hang
# does not cost the rest. Give it PAGEDBACKEND_COMMIT=<this checkout's commit>: the device copy's
# .git can be stale, and the result JSONs then name an old commit (calls 49-52 did).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-perf/logs}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stages=${*:-"kernels w1 w2 w3 correctness bench"}
# Next calls (after H100 calls 88-89, perf/RESULTS.md): on an H200 "w4runs w1awq16" (~5 min: the
# one-row tiles' read bound there, W1 AWQ in fp16, the goal's figure); anywhere "kernelsnew
# correctnessawq w5cb correctnessw8a8" (~8 min: the one-kernel argmax pick's GPU parity after
# 3343a31, then correctness; correctnessgptq passed in call 89, 2 min); "ncusrc" with
# NCU_TILES naming the one- and two-piece WORDS tiles (why two pieces run faster), "w4wide" (~2
# min: the swap-AB pair tiles at 64-8,192 rows); on an H200, "dmon w1pairs" (~5 min: W1 fp8 /
# int8 with the fp16-pair tiles at 64 registers), "dequant fp8mma" (~4 min: the W8A8 fp8 tiles at
# 1-64 rows, W1 fp8 A/B), then "w2awq" (~5 min: AWQ 0.854x bf16 on an H100) and "servefp8" (~8
# min, carry models/dummy/llama-3.1-8b: W4 with fp8 weights). Pass PAGEDBACKEND_COMMIT as a
# literal hash computed here: on the device `git rev-parse` reads a stale .git (calls 71-73).
run() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; local rc=$?
  tail -n 25 "$out/$name.log"; echo "=== $name rc=$rc"
}
in_snapshot() {  # name seconds command...: run in .snapshot/ (perf/snapshot.sh, carried), its
  # commit recorded in the results; arguments expand here, so $PWD paths name this checkout
  if [ ! -f .snapshot/COMMIT ]; then
    echo "$1: no .snapshot/ (bash perf/snapshot.sh <commit>, then carry it)"; return
  fi
  (cd .snapshot && PAGEDBACKEND_COMMIT=$(cat COMMIT) run "$@")
}
base_py=$(PATH=${PATH#/tmp/tsenv/bin:} command -v python3)
ncu_bin() { echo "${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)}"; }
# the tuners' choices (kernels/tuning_cache.py) in the checkout: carry .tuning-cache from an
# earlier call's logs (tuning-cache/ in logs.tgz) and its engines skip the tuning where the
# GPU, versions and kernel sources are the same
export PAGEDBACKEND_TUNING_CACHE=${PAGEDBACKEND_TUNING_CACHE:-$PWD/.tuning-cache}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
for s in $stages; do
  case $s in
    # the SM clock and board power each second until the call ends (nvidia-smi dmon)
    dmon) nvidia-smi dmon -s pc -d 1 > "$out/dmon.log" 2>&1 & ;;
    kernels) run kernels 240 python3 -m pytest -q -x tests/test_kernels.py ;;
    # the GPU-only engine tests of the kernels file and the newest kernels' parity, ~1 min
    kernelsnew) run kernelsnew 120 python3 -m pytest -q tests/test_kernels.py -k "skinny or compiles or argmax or layers_run or rotary or dispatch" ;;
    # the skinny GEMM's tests (every tile, the tensor-core ones included) and the no-compile test
    skinny) run skinny 300 python3 -m pytest -q tests/test_kernels.py -k "skinny or compiles" ;;
    # the decode kernel's rotary + KV write, the single-sequence prefill graphs against eager
    # steps, decode parity and the no-compile test (fresh compiles make it ~4 min)
    attn) run attn 300 python3 -m pytest -q tests/test_kernels.py -k "rope_store or backend_rope or prefill_graph or compiles or decode_matches or prefill_matches or longest_first" ;;
    # the no-compile-after-warm-up test (graphs and eager) and the decode program order, ~2 min
    compiles) run compiles 160 python3 -m pytest -q tests/test_kernels.py -k "compiles or longest_first" ;;
    # with the image's own python: transformers does not import under setup.sh's numpy 1.26
    correctness) run correctness 240 "$base_py" perf/gpu_correctness.py ;;
    # fp32 only (where all 256 greedy tokens must agree with transformers), ~2 min
    correctness32) run correctness32 200 "$base_py" perf/gpu_correctness.py --dtypes float32 ;;
    correctness16) run correctness16 200 "$base_py" perf/gpu_correctness.py --dtypes bfloat16 ;;
    # bf16 with an fp8 KV cache: how far greedy output still follows transformers
    correctnessfp8) run correctnessfp8 200 "$base_py" perf/gpu_correctness.py --dtypes bfloat16 --kv-cache-dtype fp8 ;;
    # prompt_logprobs, logit_bias and allowed_token_ids with CUDA graphs and async scheduling on
    features) run features 200 "$base_py" perf/gpu_features.py ;;
    w1) run w1 150 python3 perf/w1_decode.py --profile ;;
    w2) run w2 180 python3 perf/w2_fixed.py --shapes 128-128 --profile ;;
    # W2 2048/128, then a profile of 128 of its requests (where the prefill time goes)
    w2longprof) run w2longprof 240 python3 perf/w2_fixed.py --shapes 2048-128 --profile \
                  --profile-shape 2048-128-128 ;;
    # not run yet (perf/RESULTS.md, "Not measured yet"): prefetch only in the matmuls without a
    # prologue (o_proj), 16/32 MB, against the default (8 MB in every skinny matmul); three
    # identical engines (A-A-A: the order effect alone); W2 2048/128 with the longest-first
    # decode order against grid order, A-B-A
    w1pfplain) run w1pfplain 220 python3 perf/w1_decode.py --ab pfplain16,pfplain32 ;;
    w2order) run w2order 330 python3 perf/w2_fixed.py --shapes 128-128 --ab default,default ;;
    w2lpt) run w2lpt 330 python3 perf/w2_fixed.py --shapes 128-128,2048-128 --ab gridorder,default ;;
    w2long) run w2long 300 python3 perf/w2_fixed.py --shapes 2048-128,128-2048 ;;
    w3) run w3 120 python3 perf/w3_mix.py ;;
    # kv_cache_dtype fp8: the kernels' parity at real shapes (with the bf16 decode / prefill
    # cases), then W2 (128/128, 2048/128) and W5's requests into the engine, bf16 then fp8 KV
    fp8) run fp8 200 python3 -m pytest -q tests/test_kernels.py -k "fp8 or decode_matches or prefill_matches" ;;
    fp8bench) run fp8bench 100 python3 perf/kernels_bench.py --only fp8 ;;
    # quantization fp8 (weights in e4m3): the skinny kernel on fp8 weights and the per-row
    # quantization at real shapes, the tuner, the engine's no-compile test; then W1, W2
    # (128/128, 2048/128) and W5's requests into the engine, bf16 then fp8 weights (+ fp8 KV)
    fp8w) run fp8w 240 python3 -m pytest -q tests/test_kernels.py -k "fp8_weights or quantize_rows or tuning or dispatch or graphs-fp8" ;;
    correctnessfp8w) run correctnessfp8w 200 "$base_py" perf/gpu_correctness.py --dtypes bfloat16 --quantization fp8 ;;
    # issue 27 (fp8 past TensorRT-LLM's H200 figures, stronger baselines): one call of
    # "w1fp8tiles w2fp8 w5cb" (limits 240 + 170 + 180 s; ~8-9.5 min), then
    # "fp8quick fp8inbench correctnessfp8w" (~6 min) if time is left.
    # GPU parity of the norm / SiLU·mul kernels that quantize for the FP8 GEMM and of the
    # integer-widening one-row fp8 tiles (their PTX is compiled only here), ~1.5-2 min
    fp8quick) run fp8quick 180 python3 -m pytest -q tests/test_fp8_kernels.py ;;
    # W1 with fp8 weights, tiles tuned with the integer-widening ones, then without them
    # (fp8oldtiles); then the gpt-fast-style torch.compile decoder of the model in bf16, in the
    # same process (its compile ~1-1.5 min; W1's table is printed before it); ~3.5 min
    w1fp8tiles) run w1fp8tiles 240 python3 perf/w1_decode.py --quantization fp8 --suffix fp8 \
                  --ab fp8oldtiles --compiled-baseline ;;
    # W2 with fp8 weights + fp8 KV: 128/128, 2048/128, 128/2048 with the per-token quantization
    # in the RMSNorm / SiLU·mul kernels, then 128/128 with it in its own kernel (fp8nofuse;
    # w2fp8ab adds 2048/128 to that, ~25 s more); one process, ~3.5-4 min (170 s cut call 54
    # short in its fourth engine)
    w2fp8) run w2fp8 260 python3 perf/w2_fixed.py --shapes 128-128,2048-128,128-2048 \
             --ab-shapes 128-128 --quantization fp8 --kv-cache-dtype fp8 --suffix fp8 \
             --ab fp8nofuse ;;
    w2fp8ab) run w2fp8ab 200 python3 perf/w2_fixed.py --shapes 128-128,2048-128 \
               --quantization fp8 --kv-cache-dtype fp8 --suffix fp8 --ab fp8nofuse ;;
    # W5: transformers generate (20 s of it: its rate over a partial static batch is lower the
    # shorter the cut), transformers continuous batching (40 s at most),
    # then our engine (bf16, as both); ~2.8 min. Offline hub: continuous batching looks for a
    # flash-attention kernel on the Hub when none is installed, which must fail fast here
    w5cb) run w5cb 180 env HF_HUB_OFFLINE=1 "$base_py" perf/w5_vs_transformers.py \
            --hf-max-seconds 20 --cb-max-seconds 40 ;;
    # the fused quantizing norm / SiLU·mul against the separate kernels (512 and 8,192 rows),
    # and each widening one-row fp8 tile against the same tile with triton's cast, ~1.5 min
    fp8inbench) run fp8inbench 150 python3 perf/kernels_bench.py --only fp8in ;;
    # the W8A8 fp8 tiles (kernels/fp8_mma.py; H100 call 74): their GPU parity, the tiles
    # against torch._scaled_mm and the W8A16 pair tiles at 1-64 rows, then W1 with fp8
    # weights, W8A16 tiles then fp8w8a8, one process; ~4 min
    fp8mma) run fp8mmatests 150 python3 -m pytest -q tests/test_fp8_kernels.py -k "fp8_mma or w8a8"
            run fp8mmabench 150 python3 perf/kernels_bench.py --only fp8mma
            run w1w8a8 300 python3 perf/w1_decode.py --quantization fp8 --suffix fp8 \
              --ab fp8w8a8 ;;
    # how far greedy output with W8A8 decode follows bf16 (as correctnessfp8w does for W8A16)
    correctnessw8a8) run correctnessw8a8 200 env PAGEDBACKEND_FP8_DECODE=w8a8 "$base_py" \
                       perf/gpu_correctness.py --dtypes bfloat16 --quantization fp8 ;;
    # the compiled W1 baseline alone, ~2 min
    w1compiled) run w1compiled 200 python3 perf/w1_compiled_baseline.py ;;
    # AWQ / GPTQ / INT8 weights: the W4A16 kernels' parity and tuning at real shapes; W1 with
    # bf16, AWQ, GPTQ and INT8 dummy weights in one process (W1-llama-3.1-8b-awq-h200.json, ...);
    # W2 128/128 bf16 then AWQ
    quantkernels) run quantkernels 300 python3 -m pytest -q tests/test_quant_kernels.py ;;
    # the split-K and HALF tiles' GPU parity alone (their PTX runs only here), ~1 min
    splitk) run splitk 120 python3 -m pytest -q tests/test_quant_kernels.py -k "split_k or half" ;;
    # the W4A16 tuner's one-row choices (prologue inside or in its own kernel) against
    # dequantize + cuBLAS and bf16 cuBLAS at llama-3.1-8b's four matmuls, ~40 s
    w4bench) run w4bench 240 python3 perf/kernels_bench.py --only w4 ;;
    # W1 AWQ in fp16 alone (one engine's tuning, ~4 min; the goal's figure on an H200)
    w1awq16) run w1awq16 300 python3 perf/w1_decode.py --quantization awq --dtype float16 \
               --suffix awq-fp16 ;;
    # every WORDS tile against the HALF tiles at one row, fp16 and bf16 inputs (after "splitk",
    # their GPU parity), ~2 min
    w4words) run w4words 240 python3 perf/kernels_bench.py --only w4words ;;
    # the swap-AB W4A16 GEMM tiles' GPU parity, then each at 64, 512 and 8,192 rows against
    # dequantize + cuBLAS and bf16 cuBLAS (W2 with AWQ, issue 23), ~2 min
    w4wide) run w4widetests 150 python3 -m pytest -q tests/test_quant_kernels.py -k swap_ab
            run w4wide 280 python3 perf/kernels_bench.py --only w4wide ;;
    w1quant) run w1quant 540 python3 perf/w1_decode.py --ab awq,gptq,int8 ;;
    # W1 bf16 then AWQ only, ~2.5 min
    w1awq) run w1awq 300 python3 perf/w1_decode.py --ab awq ;;
    # the fp16-pair one-row tiles for e4m3 / int8 weights: GPU parity (their PTX), ~1 min
    bytehalf) run bytehalf 90 python3 -m pytest -q tests/test_fp8_kernels.py -k "byte_half" ;;
    # int8 (and e4m3) weights dequantized in one kernel for the int8 layers' wider matmuls
    int8wide) run int8wide 90 python3 -m pytest -q tests/test_kernels.py -k dequantize_rows ;;
    # W1 with AWQ, fp8 and int8 weights beside bf16 in one process (issues 23 and 27); the
    # engines' tuning takes most of it (330 s ran out at the third engine, H100 call 65)
    w1bytes) run w1bytes 480 python3 perf/w1_decode.py --ab awq,fp8w,int8 ;;
    # the fp16-pair one-byte tiles at 64 registers a thread (db1e338; 119-127 before): their
    # bench (on an H100, call 76, no change: gate|up reads at 80% of its HBM there), then W1
    # bf16, fp8 and int8 in one process (the H200 read them at 2.5 TB/s of 4.8, call 72); ~5 min
    w1pairs) run bytesbench 120 python3 perf/kernels_bench.py --only bytes
             run w1pairs 300 python3 perf/w1_decode.py --ab fp8w,int8 ;;
    # Nsight Compute on the tuned one-row tiles (4-bit, int8, e4m3, bf16; gate|up and down; or
    # NCU_TILES="--tile kind:shape:tile ...", tiles without spaces): stall reasons, issue rate
    # and memory pipes, ~3 min
    ncu) run ncutiles 300 "$(ncu_bin)" \
           --clock-control none --nvtx --nvtx-include "ncu/" --section SpeedOfLight \
           --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
           --section Occupancy --section LaunchStats --section InstructionStats \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
           python3 perf/ncu_tiles.py ${NCU_TILES:-} ;;
    # the same tiles' stalls per SASS instruction (PC sampling, --set full): the report, then
    # its source page as CSV (ncusass.log), ~2 min
    ncusrc) run ncusrc 240 "$(ncu_bin)" --clock-control none --nvtx --nvtx-include "ncu/" \
              --set full -f -o "$out/tiles" python3 perf/ncu_tiles.py ${NCU_TILES:-}
            run ncusass 120 "$(ncu_bin)" -i "$out/tiles.ncu-rep" --page source --csv \
              --print-source sass ;;
    # the codes alone read in the one-row tiles' pattern, row-major against tile-contiguous:
    # the read bound of the 4-bit one-row tiles (H100 call 80: 2.5-2.7 TB/s, any run), ~1 min
    w4runs) run w4runs 200 python3 perf/kernels_bench.py --only w4runs ;;
    # the 4-bit dequantization (dequantize + cuBLAS's first half) at the four shapes: the
    # word-pair kernel at a few tiles against the converting one, ~30 s
    dequant) run dequant 90 python3 perf/kernels_bench.py --only dequant ;;
    w2awq) run w2awq 480 python3 perf/w2_fixed.py --shapes 128-128 --ab awq ;;
    # greedy output on AWQ / GPTQ (act order) checkpoints of the tiny models vs transformers on
    # their dequantized weights, in fp32 (the kernels' arithmetic: all 256 tokens should agree)
    # (AWQ: the 4-bit tiles timed at decode's 1-8 rows only; all rows buckets did not fit 300 s)
    correctnessawq) run correctnessawq 300 "$base_py" perf/gpu_correctness.py --dtypes float32 \
                      --quantization awq --w4-tuned-rows 8 ;;
    correctnessgptq) run correctnessgptq 300 "$base_py" perf/gpu_correctness.py --dtypes float32 --quantization gptq-act ;;
    # decode attention at W5's mixed context lengths: grid order, longest first, splits, stages
    mixedlen) run mixedlen 120 python3 perf/kernels_bench.py --only mixedlen ;;
    w5) run w5 300 "$base_py" perf/w5_vs_transformers.py ;;
    # the same, then our run once more under torch.profiler (where W5's time goes)
    w5prof) run w5prof 360 "$base_py" perf/w5_vs_transformers.py --profile ;;
    bench) run bench 90 python3 perf/kernels_bench.py ;;
    # the same with a tile sweep per shape (decode: W2's 512 rows x 192 tokens included)
    benchsweep) run benchsweep 200 python3 perf/kernels_bench.py --sweep ;;
    # cuBLAS at llama-3.1-8b's projection shapes across row counts (W2's GEMM bound), ~30 s
    gemm) run gemm 90 python3 perf/gemm_bench.py ;;
    # the prefill kernel with the step's K/V read from k / v (the default) and gathered from
    # the cache: parity tests, the kernel timed both ways (+ a tile sweep), W2 2048/128 A-B
    contigtests) run contigtests 300 python3 -m pytest -q tests/test_kernels.py -k "prefill or rotary_store or backend_rope or fp8_kv" ;;
    # TTFT of 2k/8k/16k-token prompts alone, with the step's K/V read from k / v and gathered
    ttftlong) run ttftlong 240 python3 perf/ttft_long.py --ab pagedkv ;;
    # speculative decoding against none in one process (perf/spec_decode.py): batch 1 n-gram
    # ceiling on a repeating prompt, drafts all rejected (overhead, k = 5 and 1), batch 1-64,
    # a draft model = the target, a host profile of verification steps; ~2 min
    specdecode) run specdecode 540 python3 perf/spec_decode.py --pyprofile ;;
    # verification steps in prefill CUDA graphs against eager steps, and the engine's
    # speculative-decoding tests on the GPU (tiny models, fp32: greedy output with drafts ==
    # without, aborts, preemption, seeded sampling), ~2 min
    # (the engine tests build tiny checkpoints with transformers: the image's python, numpy 2)
    spectests) run spectests 200 python3 -m pytest -q tests/test_kernels.py::test_single_sequence_prefill_graph_matches_eager tests/test_kernels.py::test_verification_of_drafts_replays_a_prefill_graph
               run spectests-engine 200 "$base_py" -m pytest -q tests/test_spec_decode.py \
                 tests/test_engine.py::test_no_room_left_for_the_kv_cache_is_a_startup_error_on_the_gpu ;;
    # the batch-1 cases in fp32: do greedy outputs with and without speculation agree when
    # bf16 rounding is out of the way (call 50: they differed in bf16 on random weights)
    specfp32) run specfp32 300 python3 perf/spec_decode.py --dtype float32 --quick --skip-draft ;;
    # cuBLAS at the narrow steps of W4 (~30-40 rows) and W5's tail: how near HBM bandwidth
    gemmsmall) run gemmsmall 150 python3 perf/gemm_bench.py --triton --rows 1,2,4,8,16,24,32,48,64,96,128 ;;
    # issue 8, on a kind with >= 2 GPUs: TP=2 == TP=1 greedy (4 archs), W1/W2 at TP=1 and TP=2
    tp2) run tp2 420 python3 perf/tp_scaling.py --tp 2 ;;
    # W4 through Triton + the same requests offline (sources .gpu-bundle/setup.sh itself; needs
    # models/dummy/llama-3.1-8b carried along); its own steps are cut to fit ~530 s.
    serve) run serve 560 bash perf/w4_gpu.sh ;;
    # W4 at rate 16 into the engine, the default only: TTFT/TPOT and the steps by path (how
    # many run eagerly: a prompt arriving while others decode makes a mixed step)
    w4paths) run w4paths 200 "$base_py" perf/w4_engine_rate.py --rates 16 ;;
    # W1 with the engine of perf/snapshot.sh's commit (.snapshot/, carried): beside w1 in one
    # call, whether W1 moved between commits
    w1old) OUT="$out/snapshot" in_snapshot w1old 150 python3 perf/w1_decode.py ;;
    # the same 300 requests into the engine of perf/snapshot.sh's commit (.snapshot/, carried)
    w4old) OUT="$out/snapshot" in_snapshot w4old 170 "$base_py" perf/w4_engine_rate.py \
             --rates 16 --num-prompts 300 --model-dir "$PWD/models/dummy/llama-3.1-8b" ;;
    # W4 with the repository's defaults at rates inf and 16, and offline (the server's start
    # took 64 s in call 16, which left a 250 s budget no room for the Triton runs)
    servefast) run serve 340 env RATES="inf 16" ENGINE_RATES="" SKIP_PA=1 BUDGET_S=330 \
                 bash perf/w4_gpu.sh ;;
    # issue 27: W4 with fp8 weights + fp8 KV through Triton at rates inf and 16
    # (goals >= 60 req/s at inf, median TPOT <= 8 ms at 16); needs models/dummy/llama-3.1-8b
    # (bf16 first, the baseline from the same machine; ~2 min each, H100 calls 67-68)
    servefp8) run servebf16 220 env RATES="inf 16" ENGINE_RATES="" SKIP_PA=1 OFFLINE_S=0 \
                BUDGET_S=200 NAME=llama-3.1-8b bash perf/w4_gpu.sh
              run servefp8 260 env RATES="inf 16" ENGINE_RATES="" SKIP_PA=1 OFFLINE_S=0 \
                BUDGET_S=240 NAME=llama-3.1-8b-fp8 \
                EXTRA_SETTINGS="quantization=fp8 kv_cache_dtype=fp8" bash perf/w4_gpu.sh ;;
    # W4 with the repository's defaults at rates inf, 16, 4 and offline (no perf_analyzer, no
    # engine-model runs)
    servequick) run serve 420 env RATES="inf 16 4" ENGINE_RATES="" SKIP_PA=1 BUDGET_S=400 \
                  bash perf/w4_gpu.sh ;;
    # swap_space (issue 25): the host tier's copies on the GPU (bit-exact, ordered after the
    # compute stream's writes) and the engine's tests of it on the tiny models, ~1-2 min
    swaptests) run swaptests 300 "$base_py" -m pytest -q tests/test_swap.py tests/test_host_memory.py -k "not tp2" ;;
    # multi-turn chat (128 conversations x 6 turns, 2k-token histories, 32 at a time) whose
    # histories do not fit the GPU pool: TTFT p50/p99 and throughput with swap_space 0 and 32
    # in one process (goal: p50 TTFT >= 2x lower), ~3-4 min
    swapchat) run swapchat 540 python3 perf/swap_bench.py --parts chat ;;
    # W2-shaped (256 x 128/512) with the KV pool at a quarter of the need: recompute vs swap
    # vs auto throughput in one process, ~3 min
    swapw2) run swapw2 480 python3 perf/swap_bench.py --parts w2 ;;
  esac
done
jobs -p | xargs -r kill      # the dmon stage's logger
[ -d "$PAGEDBACKEND_TUNING_CACHE" ] && cp -r "$PAGEDBACKEND_TUNING_CACHE" "$out/tuning-cache"
# At most 8 files come back from a device call: everything (the result JSONs too) travels in
# one archive; the JSONs also travel alone when there are at most 7 of them.
(cd "$out" && items=$(ls -A | grep -vx logs.tgz) && [ -n "$items" ] && tar czf logs.tgz $items \
  && rm -rf $(ls -A | grep -v '\.json$' | grep -vx logs.tgz) \
  && if [ "$(ls -A | grep -c '\.json$')" -gt 7 ]; then rm -f *.json; fi)
