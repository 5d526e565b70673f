#!/usr/bin/env bash
# Runs every GPU test, compute-sanitizer (memcheck, racecheck) on a small case, and `epx bench` on the
# GPU machine. Uses prebuilt binaries from $EPX_GPU_BIN (default .carry/bin: epx and epx_gpu_*),
# else builds into build-gpu-check (needs GoogleTest etc. installed). Logs and JSON go to $OUT (or
# ./gpu-check-out); at most a handful of files, since the device tool brings back only 8.
# The Python package is built there too (build-gpu-py, the machine's Python 3.12 + torch) and its tests
# run: python/tests (host backend, numpy and torch CPU) and python/tests/gpu (CUDA, torch); DeepEP's own
# public suites run unchanged against the epx.deep_ep shim when a DeepEP checkout is carried in
# .carry/DeepEP (git-ignored; only its tests/ are used, nothing of it is built).
# Usage: scripts/gpu-check.sh [--quick] [--python-only]
#   --quick: tests only, bench at 24 SMs; --python-only: only the Python package and its tests
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-check-out}
BIN=${EPX_GPU_BIN:-$ROOT/.carry/bin}
QUICK=0
PYTHON_ONLY=0
for arg in "$@"; do
  [ "$arg" = "--quick" ] && QUICK=1
  [ "$arg" = "--python-only" ] && PYTHON_ONLY=1
done
PY=${EPX_PYTHON:-/opt/torch/.venv/bin/python3}
mkdir -p "$OUT"
export EPX_LL_TIMING_JSON=${EPX_LL_TIMING_JSON:-$OUT/ll_timing.json}  # low-latency timing test
LOG=$OUT/gpu-check.log
: >"$LOG"
# NCCL and cuBLAS come from the pip packages next to torch on the GPU machine (no toolkit libraries there).
PIP_NVIDIA=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export LD_LIBRARY_PATH=$PIP_NVIDIA/nccl/lib:$PIP_NVIDIA/cublas/lib:$PIP_NVIDIA/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

# One build tree for the library, the CLI, the GPU tests and the Python extension. The GPU machine has
# no -dev packages: their headers/CMake configs are carried in .carry/deps (copied from a Debian machine).
BUILD=$ROOT/build-gpu
configure_gpu_build() {
  [ -f "$BUILD/build.ninja" ] && return 0
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TESTS=ON -DEPX_BUILD_BENCH=OFF \
    -DEPX_PYTHON=ON -DPython_EXECUTABLE="$PY" -DEPX_NCCL_ROOT="$PIP_NVIDIA/nccl" \
    -DCMAKE_PREFIX_PATH="$ROOT/.carry/deps;$ROOT/.carry/deps/lib/x86_64-linux-gnu/cmake;$ROOT/.carry/deps/share/cmake" \
    >>"$LOG" 2>&1
}

declare -a NAMES RESULTS
status=0
record() {  # name, rc[, extra]
  NAMES+=("$1")
  RESULTS+=("rc=$2${3:+ $3}")
  [ "$2" -eq 0 ] || status=1
}

# ---- the Python package (built here: the machine's Python differs from the developers') ----
if [ -x "$PY" ]; then
  echo "== python package build ($PY)" >>"$LOG"
  start=$(date +%s)
  configure_gpu_build && ninja -C "$BUILD" _epx >>"$LOG" 2>&1
  rc=$?
  record "python build" $rc "$(($(date +%s) - start))s"
  if [ $rc -eq 0 ]; then
    export PYTHONPATH=$BUILD/python
    for suite in "python/tests --ignore=python/tests/gpu" python/tests/gpu; do
      echo "== pytest $suite" >>"$LOG"
      start=$(date +%s)
      (cd "$ROOT" && timeout 400 "$PY" -m pytest -q -p no:cacheprovider $suite) >>"$LOG" 2>&1
      rc=$?
      record "pytest ${suite%% *}" $rc "$(($(date +%s) - start))s $(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1)"
    done
    if [ -d "$ROOT/.carry/DeepEP/tests" ]; then
      for suite in test_intranode.py test_low_latency.py; do
        echo "== DeepEP tests/$suite against the epx.deep_ep shim" >>"$LOG"
        start=$(date +%s)
        (cd "$ROOT/.carry/DeepEP/tests" && PYTHONPATH=$ROOT/python/deep_ep_shim:$PYTHONPATH \
          timeout 300 "$PY" $suite --num-processes 2) >"$OUT/deepep_${suite%.py}.log" 2>&1
        rc=$?
        record "DeepEP $suite (shim)" $rc "$(($(date +%s) - start))s"
      done
    fi
    unset PYTHONPATH
  fi
fi
if [ $PYTHON_ONLY -eq 1 ]; then
  echo; echo "gpu-check summary (log: $LOG)"
  for i in "${!NAMES[@]}"; do printf '  %-34s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
  exit $status
fi

if [ ! -x "$BIN/epx" ]; then
  echo "no prebuilt binaries in $BIN: building in $BUILD" | tee -a "$LOG"
  start=$(date +%s)
  configure_gpu_build && ninja -C "$BUILD" >>"$LOG" 2>&1 || { echo "build failed (see $LOG)"; tail -30 "$LOG"; exit 1; }
  record "C++ build" 0 "$(($(date +%s) - start))s"
  BIN=$BUILD
  cp "$BUILD"/tests/epx_gpu_* "$BIN"/ 2>/dev/null || true
fi

{
  echo "== $(date -u +%FT%TZ) $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -8
} >>"$LOG"

for t in "$BIN"/epx_gpu_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  echo "== $name" >>"$LOG"
  start=$(date +%s)
  timeout 300 "$t" --gtest_brief=1 >>"$LOG" 2>&1
  rc=$?
  NAMES+=("$name")
  RESULTS+=("rc=$rc $(($(date +%s) - start))s")
  [ $rc -eq 0 ] || status=1
done

# NOTE: 2-rank cases only: the sanitizers serialize kernels, so two ranks that share a GPU (and wait on
# each other) cannot make progress under them.
# compute-sanitizer memcheck + racecheck of one test binary on a small filter.
sanitize() {  # binary, gtest filter, label
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool ($3)" >>"$LOG"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/$1" --gtest_filter="$2" >>"$LOG" 2>&1
    rc=$?
    NAMES+=("sanitizer-$tool ($3)")
    RESULTS+=("rc=$rc")
    [ $rc -eq 0 ] || status=1
  done
}
SMS=8,16,24,32,48,64
[ $QUICK -eq 1 ] && SMS=24
echo "== epx bench --sms $SMS" >>"$LOG"
timeout 400 "$BIN/epx" bench --sms $SMS --json "$OUT/bench.json" >"$OUT/bench.txt" 2>>"$LOG"
rc=$?
NAMES+=("epx bench")
RESULTS+=("rc=$rc")
[ $rc -eq 0 ] || status=1

# The same phases driven from Python (binding cost: target within 5% of the CLI's numbers).
if ls "$BUILD"/python/epx/_epx*.so >/dev/null 2>&1; then
  echo "== python -m epx.bench" >>"$LOG"
  PYTHONPATH=$BUILD/python timeout 300 "$PY" -m epx.bench --sms 24 --compare "$OUT/bench.json" \
    --json "$OUT/python_bench.json" >"$OUT/python_bench.txt" 2>>"$LOG"
  record "python -m epx.bench" $?
fi

# DP gather/scatter + metadata sync, and the two-batch-overlap demo.
for extra in dp tbo; do
  echo "== epx bench --$extra" >>"$LOG"
  timeout 200 "$BIN/epx" bench --$extra --json "$OUT/bench_$extra.json" >"$OUT/bench_$extra.txt" 2>>"$LOG"
  rc=$?
  NAMES+=("epx bench --$extra")
  RESULTS+=("rc=$rc")
  [ $rc -eq 0 ] || status=1
done

# Sanitizers last: the benchmarks above matter more when the device time runs short.
if [ $QUICK -eq 0 ] && command -v compute-sanitizer >/dev/null; then
  # NOTE: the sanitizer serialises kernels, so only cases whose ranks sit on distinct GPUs (or whose
  # sends precede every wait, as in the low-latency kernels) can run under it.
  [ -x "$BIN/epx_gpu_normal_test" ] &&
    sanitize epx_gpu_normal_test 'NormalGpuTest.Ep2SmallShapesAndInt32Topk:NormalGpuTest.Ep2WorstTokens' normal
  [ -x "$BIN/epx_gpu_low_latency_kernels_test" ] &&
    sanitize epx_gpu_low_latency_kernels_test 'LowLatencyKernels.SmallCase' low-latency
fi


echo
echo "gpu-check summary (log: $LOG)"
for i in "${!NAMES[@]}"; do printf '  %-34s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
cat "$OUT/bench.txt" "$OUT/bench_dp.txt" "$OUT/bench_tbo.txt" "$OUT/python_bench.txt" 2>/dev/null
exit $status
