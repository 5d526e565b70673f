#!/usr/bin/env bash
# The main job: installs what epx needs, builds it, and runs `epx bench` on all visible GPUs
# (on the host backend when there is none). Extra arguments go to `epx bench` (see `epx bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_BENCH=OFF \
  -DEPX_PYTHON=OFF >/dev/null
cmake --build build -j "$(nproc)" --target epx_cli
./build/epx bench --json build/bench.json "$@"
