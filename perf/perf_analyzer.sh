#!/usr/bin/env bash
# Streaming load on the ensemble with perf_analyzer (tritonclient 2.51), e.g.
#   perf/perf_analyzer.sh                              # 127.0.0.1:8001, concurrency 1..4
#   perf/perf_analyzer.sh -u 127.0.0.1:18001 --concurrency-range 8:8
# Extra arguments go to perf_analyzer. perf_analyzer sends every input the model declares, so
# perf/ensemble_input.json gives all of them sane values (random data would ask for absurd
# max_tokens and be rejected). Environment: URL, CONCURRENCY, INPUT_DATA, MEASUREMENT_INTERVAL (ms),
# PERF_ANALYZER (the binary; .gpu-bundle/setup.sh sets it and its libraries, so the search below
# is skipped).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
venv="${VENV:-$root/.venv}"
pa="${PERF_ANALYZER:-$(command -v perf_analyzer || echo "$venv/bin/perf_analyzer")}"
py="$venv/bin/python"

# perf_analyzer needs libcudart.so.12 (pip nvidia-cuda-runtime-cu12) and libb64.so.0d (apt
# libb64-0d, or the copy bundled in the nvidia-pytriton wheel, linked under its usual name).
if [ -z "${PERF_ANALYZER:-}" ] && [ -x "$py" ]; then
  libs="$(mktemp -d)"
  trap 'rm -rf "$libs"' EXIT
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  [ -d "$site/nvidia/cuda_runtime/lib" ] && libs_path="$site/nvidia/cuda_runtime/lib" || libs_path=""
  if ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
    b64="$(ls "$site"/nvidia_pytriton.libs/libb64-*.so.0d 2>/dev/null | head -1 || true)"
    [ -n "$b64" ] && ln -s "$b64" "$libs/libb64.so.0d"
  fi
  export LD_LIBRARY_PATH="$libs:${libs_path}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

"$pa" -m ensemble -i grpc --streaming -u "${URL:-127.0.0.1:8001}" \
  --input-data "${INPUT_DATA:-$here/ensemble_input.json}" \
  --concurrency-range "${CONCURRENCY:-1:4}" --measurement-interval "${MEASUREMENT_INTERVAL:-10000}" \
  --stability-percentage 50 --max-trials 3 "$@"
