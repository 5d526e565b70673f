#!/usr/bin/env bash
# Runs every GPU test, compute-sanitizer (memcheck, racecheck) on a small case, and `epx bench` on the
# GPU machine. Uses prebuilt binaries from $EPX_GPU_BIN (default .carry/bin: epx and epx_gpu_*),
# else builds into build-gpu-check (needs GoogleTest etc. installed). Logs and JSON go to $OUT (or
# ./gpu-check-out); at most a handful of files, since the device tool brings back only 8.
# Usage: scripts/gpu-check.sh [--quick]   (--quick: tests only, bench at 24 SMs)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-check-out}
BIN=${EPX_GPU_BIN:-$ROOT/.carry/bin}
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
mkdir -p "$OUT"
export EPX_LL_TIMING_JSON=${EPX_LL_TIMING_JSON:-$OUT/ll_timing.json}  # low-latency timing test
LOG=$OUT/gpu-check.log
: >"$LOG"
# NCCL and cuBLAS come from the pip packages next to torch on the GPU machine (no toolkit libraries there).
PIP_NVIDIA=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export LD_LIBRARY_PATH=$PIP_NVIDIA/nccl/lib:$PIP_NVIDIA/cublas/lib:$PIP_NVIDIA/cu13/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

if [ ! -x "$BIN/epx" ]; then
  echo "no prebuilt binaries in $BIN: building" | tee -a "$LOG"
  cmake -S "$ROOT" -B "$ROOT/build-gpu-check" -G Ninja -DCMAKE_BUILD_TYPE=Release >>"$LOG" 2>&1 &&
    ninja -C "$ROOT/build-gpu-check" >>"$LOG" 2>&1 || { echo "build failed (see $LOG)"; exit 1; }
  BIN=$ROOT/build-gpu-check
  cp "$ROOT"/build-gpu-check/tests/epx_gpu_* "$BIN"/ 2>/dev/null || true
fi

{
  echo "== $(date -u +%FT%TZ) $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -8
} >>"$LOG"

declare -a NAMES RESULTS
status=0
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
cat "$OUT/bench.txt" "$OUT/bench_dp.txt" "$OUT/bench_tbo.txt" 2>/dev/null
exit $status
