#!/usr/bin/env bash
# One batched GPU session: install carried wheels (.whl/), build the extension, print the
# environment report, run the GPU tests and the benchmarks. Logs and results go to $OUT
# (default: results/), at most 8 files.
#   bash benchmarks/run_on_device.sh [pytest -k expression]
# Env: SANITIZE=1 (compute-sanitizer memcheck + racecheck on a subset), RMSNORM_BENCH=1 (also the
# rmsnorm benchmarks), OPS_BENCH=0 (skip benchmark_ops), TRANSFORMER_BENCH="<args>;<args>" (runs
# benchmark_transformer.py once per ;-separated argument list), VIDEO_BENCH="<args>;<args>" (runs
# scripts/generate_video.py --weights random once per list; JSON and chart to $OUT/bench/video_<i>.*,
# the video to /tmp), BACKWARD_BENCH=1 (benchmark_ops.py --backward), TRAINING_BENCH="<args>" (runs
# benchmark_training.py with those arguments), SKIP_TESTS=1, SKIP_BENCH=1.
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
start=$(date +%s)
if ! MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install -e . --no-build-isolation >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -m ltx_kernels 2>&1 | tee "$OUT/env.txt"
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest tests -q -m gpu --maxfail=20 -rf --durations=5 ${1:+-k "$1"} 2>&1 | tee "$OUT/tests.log" | tail -25
if [ "${SANITIZE:-0}" = 1 ]; then  # memcheck and racecheck over every kernel path, on small inputs
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest tests -q -m gpu \
      -k "${SANITIZE_K:-hidden_size_paths or batched_views or every_weight_dtype or (matches_reference and 2048 and 4096) or (attention_op and not large) or (attention_int8 and not large) or (attention_quant and not model_lengths and not compiles)}" \
      2>&1 | tail -3
    echo "compute-sanitizer $tool exit code: ${PIPESTATUS[0]}"
  done 2>&1 | tee "$OUT/sanitizer.log"
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
{
  [ "${OPS_BENCH:-1}" = 0 ] || python3 benchmarks/benchmark_ops.py --out "$OUT/bench"
  [ "${BACKWARD_BENCH:-0}" = 0 ] || python3 benchmarks/benchmark_ops.py --backward --out "$OUT/bench"
  # shellcheck disable=SC2086  # word splitting of the argument list is intended
  [ -z "${TRAINING_BENCH+set}" ] || python3 benchmarks/benchmark_training.py $TRAINING_BENCH --out "$OUT/bench"
  IFS=';' read -ra transformer_runs <<<"${TRANSFORMER_BENCH:-}"
  for run_args in "${transformer_runs[@]}"; do
    # shellcheck disable=SC2086  # word splitting of the argument list is intended
    python3 benchmarks/benchmark_transformer.py $run_args --out "$OUT/bench"
  done
  IFS=';' read -ra video_runs <<<"${VIDEO_BENCH:-}"
  for i in "${!video_runs[@]}"; do
    # shellcheck disable=SC2086
    python3 scripts/generate_video.py --weights random --no-progress ${video_runs[$i]} \
      --output "/tmp/videos/video_$i.mp4" --json "$OUT/bench/video_$i.json" --chart "$OUT/bench/video_$i.png"
  done
  if [ "${RMSNORM_BENCH:-0}" = 1 ]; then
    for weight in bf16 none; do
      python3 benchmarks/benchmark_rmsnorm.py --weight "$weight" --out "$OUT/bench"
    done
    echo "## the same with programmatic dependent launch off (LTX_KERNELS_PDL=0)"
    LTX_KERNELS_PDL=0 python3 benchmarks/benchmark_rmsnorm.py --weight bf16 --out "$OUT/bench_nopdl"
  fi
} 2>&1 | tee "$OUT/bench.log"
tar czf "$OUT/bench.tgz" -C "$OUT" bench $(ls -d "$OUT/bench_nopdl" 2>/dev/null | xargs -r -n1 basename) \
  && rm -rf "$OUT/bench" "$OUT/bench_nopdl"
