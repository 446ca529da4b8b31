#!/usr/bin/env bash
# W4, serving through Triton, in one device call: tritonserver on llama-3.1-8b (load_format=dummy,
# bf16), perf/serve_bench.py (500 ShareGPT-shaped requests, seed 0, gRPC streaming to the
# ensemble, ignore_eos) at request rates inf, 16, 4; perf_analyzer (streaming, ensemble) at
# concurrency 16, 64, 128; then, with the server stopped, the same 500 requests all at once through
# LLM.generate (perf/w4_offline.py) and the ratio Triton / offline at rate inf (goal >= 0.9).
#
# On the GPU host, from the repo root (models/dummy/llama-3.1-8b carried along, made here with
# `python scripts/prepare_model.py --dummy llama-3.1-8b`):
#   source .gpu-bundle/setup.sh && bash perf/w4_gpu.sh        # setup.sh is sourced if needed
# CPU smoke run (the .venv's tritonserver and perf_analyzer, real SmolLM2 weights):
#   MODEL_DIR=models/smollm2-135m-instruct LOAD_FORMAT=auto DTYPE=auto NUM_PROMPTS=20 SCALE=0.1 \
#     RATES="inf 8" CONCURRENCIES="2" bash perf/w4_gpu.sh
# Environment: MODEL_DIR NAME LOAD_FORMAT DTYPE MAX_NUM_SEQS MAX_MODEL_LEN GPU_MEMORY_UTILIZATION
# EXTRA_SETTINGS ("k=v ...") NUM_PROMPTS SCALE RATES CONCURRENCIES TARGET (ensemble|engine)
# ENGINE_RATES (default "inf": these rates also to the engine model, token ids; ENGINE_INF=0 or
# ENGINE_RATES="" for none) SKIP_PA (1: no perf_analyzer) PA_INTERVAL_MS BUDGET_S
# START_TIMEOUT OFFLINE_S (0: no offline run) PYTHON TRITONSERVER PERF_ANALYZER OUT.
# perf_analyzer: 3 windows of PA_INTERVAL_MS (8 s: longer than one request) per concurrency, no
# stability requirement (W4-mean
# requests: prompt ~202, max_tokens 179, 256 different prompts, a cache salt per level).
# Every step has its own time limit, cut to what is left of BUDGET_S (keeping OFFLINE_S for the
# offline run), so one failure or hang costs only itself; the server is stopped on any exit.
# Step logs: $OUT (default perf/logs/w4). Results: perf/results/ and copies in $OUT.
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)

if [ -z "${TRITONSERVER:-}" ] && [ -f .gpu-bundle/setup.sh ] && command -v nvidia-smi >/dev/null
then
  # shellcheck disable=SC1091
  source .gpu-bundle/setup.sh
fi
# On the GPU host, scikit-learn and scipy are built for numpy 2 while the Triton stub needs the
# bundle's numpy 1.26, and `from transformers import AutoTokenizer` imports sklearn (through its
# generation utilities) and dies on it. Hide sklearn from the bundle's python with a .pth line;
# transformers then treats it as not installed.
if [ -n "${TRITONSERVER:-}" ] && ! python3 -c "from transformers import AutoTokenizer" 2>/dev/null
then
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import sys; sys.modules.setdefault('sklearn', None)" > "$site/zz_hide_sklearn.pth"
  python3 -c "from transformers import AutoTokenizer" \
    && echo "sklearn hidden from $(command -v python3): AutoTokenizer imports under numpy<2"
fi
# The launcher takes the tritonserver found on PATH.
[ -n "${TRITONSERVER:-}" ] && export PATH="$(dirname "$TRITONSERVER"):$PATH"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -z "${TRITONSERVER:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

MODEL_DIR=${MODEL_DIR:-models/dummy/llama-3.1-8b}
NAME=${NAME:-$(basename "$MODEL_DIR")}
NUM_PROMPTS=${NUM_PROMPTS:-500}
SCALE=${SCALE:-1.0}
RATES=${RATES:-"inf 16 4"}
CONCURRENCIES=${CONCURRENCIES:-"16 64 128"}
TARGET=${TARGET:-ensemble}
ENGINE_RATES=${ENGINE_RATES-inf}
[ "${ENGINE_INF:-1}" = 0 ] && ENGINE_RATES=""
PA_INTERVAL_MS=${PA_INTERVAL_MS:-8000}
BUDGET_S=${BUDGET_S:-535}
START_TIMEOUT=${START_TIMEOUT:-180}
OFFLINE_S=${OFFLINE_S:-150}
OUT=${OUT:-perf/logs/w4}
export OUT PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
SETTINGS=()
for kv in "load_format=${LOAD_FORMAT:-dummy}" "dtype=${DTYPE:-bfloat16}" \
          "max_num_seqs=${MAX_NUM_SEQS:-512}" "max_model_len=${MAX_MODEL_LEN:-4096}" \
          "gpu_memory_utilization=${GPU_MEMORY_UTILIZATION:-0.9}" ${EXTRA_SETTINGS:-}; do
  SETTINGS+=(--setting "$kv")
done
# PERF_ASYNC=0/1 (as the other perf scripts): async scheduling off/on, result files get -sync
[ -n "${PERF_ASYNC:-}" ] && SETTINGS+=(--setting "async_scheduling=$([ "$PERF_ASYNC" = 1 ] &&
  echo true || echo false)")

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# "want min" seconds for a serve_bench step at a rate: the arrivals alone take NUM_PROMPTS / rate
# seconds; at rate inf, want = $2 and min = 30.
rate_limits() {
  if [ "$1" = inf ]; then echo "$2 30"; return; fi
  awk -v n="$NUM_PROMPTS" -v r="$1" 'BEGIN { printf "%d %d\n", 60 + 1.15 * n / r, 15 + n / r }'
}

STEP_PID=
step() {  # name want_s min_s reserve_s command...: run with limit min(want, left - reserve)
  local name=$1 want=$2 min=$3 reserve=$4; shift 4
  local lim=$(( $(left) - reserve )); (( lim > want )) && lim=$want
  if (( lim < min )); then
    echo "=== $name skipped: ${lim}s left of the budget, needs ${min}s"; return 99
  fi
  echo "=== $name (limit ${lim}s, $(date +%T))"
  local t=$(date +%s)
  # In the background, so a SIGTERM to this script is handled at once (wait is interruptible).
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"; local rc=$?
  STEP_PID=
  tail -n 3 "$OUT/$name.log" | cut -c1-160
  echo "=== $name rc=$rc in $(( $(date +%s) - t ))s"
  return $rc
}

SUP_PID= SERVER_PGID=
stop_server() {
  [ -n "$SUP_PID" ] || return 0
  kill -TERM "$SUP_PID" 2>/dev/null
  for _ in $(seq 80); do kill -0 "$SUP_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$SUP_PID" 2>/dev/null
  wait "$SUP_PID" 2>/dev/null
  SUP_PID=
  if [ -n "$SERVER_PGID" ] && pgrep -g "$SERVER_PGID" >/dev/null 2>&1; then
    echo "left in the server's process group, killed:"; ps -o pid,cmd -g "$SERVER_PGID"
    kill -KILL -- "-$SERVER_PGID" 2>/dev/null; sleep 1
  fi
  if command -v nvidia-smi >/dev/null; then   # the offline run needs the GPU memory back
    local used=
    for _ in $(seq 30); do    # memory.used, not the process list (empty inside a container)
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null |
             head -n 1)
      [[ $used =~ ^[0-9]+$ ]] || break
      (( used < 2048 )) && break
      sleep 1
    done
    echo "GPU memory used after the server stopped: ${used:-?} MiB"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null
  fi
}
cleanup() {
  [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID" 2>/dev/null
  stop_server
}
trap cleanup EXIT
trap 'echo "=== interrupted"; exit 143' TERM INT HUP

# -- the model directory ----------------------------------------------------------------------
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "MODEL_DIR=$MODEL_DIR has no config.json: make it with" \
       "'python scripts/prepare_model.py --dummy llama-3.1-8b' and carry it along" >&2
  exit 2
fi
kib=$(du -sk "$MODEL_DIR" | cut -f1)
echo "model $MODEL_DIR: $(( kib / 1024 )) MiB, ${SETTINGS[*]}"
[ "${LOAD_FORMAT:-dummy}" = dummy ] && (( kib > 16384 )) &&
  echo "warning: $MODEL_DIR is over 16 MiB for a dummy model (config + tokenizer are ~3.4 MiB)"
echo "python $(command -v "$PY"), tritonserver ${TRITONSERVER:-(launcher: PATH or nvidia-pytriton)}"
command -v nvidia-smi >/dev/null && \
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
# The result files' <gpu> as common.gpu_tag() names it (torch's device name is the driver's).
GPU=cpu
if name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) && [ -n "$name" ]; then
  GPU=$(echo "${name%%$'\n'*}" | sed 's/NVIDIA //; s/ /-/g' | tr '[:upper:]' '[:lower:]')
fi

# -- the server -------------------------------------------------------------------------------
state="$OUT/server.state"; rm -f "$state"
echo "=== server start ($(date +%T))"
"$PY" perf/w4_tools.py serve --model-dir "$MODEL_DIR" "${SETTINGS[@]}" --state "$state" \
  --log "$OUT/triton.log" --timeout "$START_TIMEOUT" > "$OUT/server.log" 2>&1 &
SUP_PID=$!
READY=0
for _ in $(seq $(( 2 * (START_TIMEOUT + 10) ))); do
  if [ -f "$state" ]; then
    # shellcheck disable=SC1090
    source "$state"
    [ "$READY" = 1 ] && break
  fi
  kill -0 "$SUP_PID" 2>/dev/null || break
  sleep 0.5
done
if [ "$READY" = 1 ]; then
  echo "=== server ready in ${START_S}s: gRPC $GRPC_URL (log $OUT/triton.log)"
else
  echo "=== server not ready; last lines of $OUT/triton.log:"; tail -n 15 "$OUT/triton.log"
  tail -n 3 "$OUT/server.log"
fi

# -- serve_bench at each rate, perf_analyzer at each concurrency --------------------------------
reserve=$(( OFFLINE_S + 20 ))   # kept for stopping the server and the offline run
bench=("$PY" perf/serve_bench.py --model "$TARGET" --model-dir "$MODEL_DIR" --name "$NAME"
       --num-prompts "$NUM_PROMPTS" --scale "$SCALE")
# Triton's per-model statistics after each step: which hop of the ensemble the responses wait on
mkdir -p "$OUT/stats"
snap() { timeout 20 "$PY" perf/w4_tools.py stats --http "$HTTP_URL" --out-dir "$OUT/stats" --label "$1" \
           >> "$OUT/stats.txt" 2>&1; }
if [ "$READY" = 1 ]; then
  snap start
  first=1
  for rate in $RATES; do
    read -r want min < <(rate_limits "$rate" 150)
    warm=(); (( first )) && warm=(--warmup 16)
    step "w4-rate-$rate" "$want" "$min" "$reserve" "${bench[@]}" --url "$GRPC_URL" \
      --request-rate "$rate" --cache-salt "w4-rate-$rate" --details "$OUT/details-$rate.csv" \
      "${warm[@]}"
    snap "rate-$rate"
    first=0
  done
  [ "${SKIP_PA:-0}" = 1 ] && CONCURRENCIES=""
  [ -n "$CONCURRENCIES" ] && step pa-input 60 10 "$reserve" "$PY" perf/w4_tools.py pa-input --model-dir "$MODEL_DIR" \
    --out-dir "$OUT/pa" --scale "$SCALE" --concurrency $CONCURRENCIES
  for c in $CONCURRENCIES; do
    rm -f "$OUT/pa-c$c.csv"
    step "pa-c$c" 60 30 "$reserve" env URL="$GRPC_URL" CONCURRENCY="$c:$c" \
      INPUT_DATA="$OUT/pa/pa_input_c$c.json" MEASUREMENT_INTERVAL="$PA_INTERVAL_MS" \
      bash perf/perf_analyzer.sh -f "$OUT/pa-c$c.csv" --stability-percentage 999
    snap "pa-c$c"
  done
  # the same requests to the engine model (token ids, no tokenizer/guard/detokenizer hops)
  if [ "$TARGET" != engine ]; then
    for rate in $ENGINE_RATES; do
      read -r want min < <(rate_limits "$rate" 60)
      step "w4-engine-rate-$rate" "$want" "$min" "$reserve" "${bench[@]}" --url "$GRPC_URL" \
        --model engine --name "$NAME-engine" --request-rate "$rate" \
        --cache-salt "w4-engine-$rate" --details "$OUT/details-engine-$rate.csv"
      snap "engine-rate-$rate"
    done
  fi
  [ -f "$OUT/stats.txt" ] && cat "$OUT/stats.txt"
fi
echo "=== server stop ($(date +%T))"
stop_server
grep -E "engine ready|Traceback|Error" "$OUT/triton.log" | head -n 5 | cut -c1-200
# the engine loop's own account of its last busy periods (one per step at rate inf; at low
# rates the engine idles between requests and each burst is a period of its own)
grep -o "busy period: .*" "$OUT/triton.log" | tail -n 10 | cut -c1-600

# -- the same requests offline ----------------------------------------------------------------
(( OFFLINE_S > 0 )) && step w4-offline "$OFFLINE_S" 30 10 "$PY" perf/w4_offline.py --model-dir "$MODEL_DIR" \
  --name "$NAME" "${SETTINGS[@]}" --target "$TARGET" --num-prompts "$NUM_PROMPTS" \
  --scale "$SCALE" --since "$T0"

echo "=== done in $(( $(date +%s) - T0 ))s"
timeout 60 "$PY" perf/w4_tools.py summary --name "$NAME" --gpu "$GPU" --rates "$RATES" \
  --engine-rates "$ENGINE_RATES" \
  --concurrency $CONCURRENCIES --out-dir "$OUT" --since "$T0"
