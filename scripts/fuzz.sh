#!/usr/bin/env bash
# Runs every libFuzzer target of tests/fuzz for SECONDS each (default 300), all at once, each over its
# committed seed corpus (tests/fuzz/corpus/<target>/, read only) plus a growing corpus of its own in
# BUILD/fuzz/<target>/corpus (kept between local runs). Exits non-zero when a target finds a crash, a
# sanitizer error, a broken invariant, a leak, a slow input (> 10 s) or runs out of memory (> 2 GiB); the
# reproducer is BUILD/fuzz/<target>/crash-* (or leak-*, timeout-*, oom-*): run `BUILD/tests/fuzz/epx_<target>
# FILE` to see it again, and add it to the target's corpus once fixed so CTest keeps checking it.
#
#   scripts/fuzz.sh [SECONDS]         e.g. scripts/fuzz.sh 3600 for an hour per target
#
# BUILD is $EPX_FUZZ_BUILD_DIR (default build-fuzz). When it has no CMake cache yet it is configured as a
# clang, host-only AddressSanitizer + UndefinedBehaviorSanitizer build with the fuzz targets
# (-DEPX_BUILD_FUZZ=ON); scripts/test.sh passes its own build-asan, configured the same way with tests on.
# Needs clang and libFuzzer (scripts/install-deps.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-300}
build=${EPX_FUZZ_BUILD_DIR:-build-fuzz}
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/fuzz.sh [SECONDS]  (a positive whole number; got '$seconds')" >&2
  exit 2
fi

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DEPX_CUDA=OFF -DEPX_WERROR=ON \
    -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_BENCH=OFF -DEPX_SANITIZE=address,undefined -DEPX_BUILD_FUZZ=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target epx_fuzz

targets=()
for src in tests/fuzz/*_fuzz.cpp; do targets+=("$(basename "$src" .cpp)"); done
echo "== fuzzing ${targets[*]} for ${seconds} s each (all at once, $(nproc) cores)"
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=detect_leaks=1
pids=()
for t in "${targets[@]}"; do
  out="$build/fuzz/$t"
  mkdir -p "$out/corpus"
  dict=()
  [ -f "tests/fuzz/$t.dict" ] && dict=("-dict=tests/fuzz/$t.dict")
  # -close_fd_mask=1: the targets' stdout (CLI results, help) is dropped; libFuzzer reports on stderr.
  "$build/tests/fuzz/epx_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -close_fd_mask=1 -artifact_prefix="$out/" "${dict[@]}" "$out/corpus" "tests/fuzz/corpus/$t" \
    >"$out/log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  t=${targets[$i]}
  if wait "${pids[$i]}"; then
    runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$build/fuzz/$t/log" | grep -o '[0-9]*$' || true)
    cov=$(grep -o 'cov: [0-9]*' "$build/fuzz/$t/log" | tail -1 || true)
    echo "$t: ok, ${runs:-?} inputs, $cov, corpus $(ls "$build/fuzz/$t/corpus" | wc -l) + $(ls "tests/fuzz/corpus/$t" | wc -l) seeds"
  else
    failed=1
    echo "$t: FAILED; the end of $build/fuzz/$t/log:"
    tail -n 60 "$build/fuzz/$t/log"
    ls "$build/fuzz/$t"/{crash,leak,timeout,oom,slow-unit}-* 2>/dev/null || true
  fi
done
exit "$failed"
