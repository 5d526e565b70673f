#!/usr/bin/env bash
# Builds the GPU binaries of scripts/gpu-check.sh on this (development) machine, sm_90, and copies them stripped into
# .gl/build (git-ignored; ~45 MB, under the device tool's 64 MiB carry limit), laid out as a build tree:
#   EPX_GPU_BUILD=.gl/build scripts/gpu-check.sh --steps tests,bench     (device call with carry [".gl"])
# The CUDA runtime is linked statically; NCCL and cuBLAS resolve on the GPU machine from the torch venv's pip packages
# (gpu-check sets LD_LIBRARY_PATH); glibc and libstdc++ there are newer than Debian 12's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${EPX_BINS_BUILD:-$ROOT/build}
DEST=$ROOT/.gl/build
[ -f "$B/build.ninja" ] || cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TESTS=ON \
  -DEPX_BUILD_BENCH=OFF -DEPX_CUDA=ON
# Every GPU test binary (tests/gpu/*_test.*), ~6 MB each stripped: with the CLI ~45 MB, under the 64 MiB carry.
targets=(epx)
for src in "$ROOT"/tests/gpu/*_test.c*; do
  name=$(basename "$src")
  targets+=("epx_gpu_${name%.*}")
done
ninja -C "$B" "${targets[@]}"
rm -rf "$DEST" && mkdir -p "$DEST/tests"
strip -o "$DEST/epx" "$B/epx"
for t in "${targets[@]:1}"; do strip -o "$DEST/tests/$t" "$B/tests/$t"; done
du -sh "$DEST"
