#!/usr/bin/env bash
# The test command: installs what the tests need (Debian packages and PyPI packages by name), builds epx
# and its Python extension (with the CUDA backend when a toolkit is present, else host-only), runs every
# CPU test, installs the Python package with `pip install .` from the same build tree and runs pytest on
# it (host backend, numpy), runs the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer
# (clang, host-only build, which also builds the libFuzzer targets), runs each fuzz target for
# $EPX_FUZZ_SECONDS (default 30) over its seed corpus (scripts/fuzz.sh), runs `epx bench` on the host
# backend, and checks that an installed epx is usable through find_package(epx). An empty test run is a
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

bash scripts/install-deps.sh

echo "== build (warnings are errors)"
# Every option is set explicitly: scripts/bench.sh shares build/ and turns tests off there.
cmake -S . -B build -G Ninja -DEPX_WERROR=ON -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_TESTS=ON \
  -DEPX_BUILD_BENCH=ON -DEPX_PYTHON=ON >/dev/null
cmake --build build -j "$jobs"
echo "== CPU tests"
ctest --test-dir build --output-on-failure -j "$jobs" --no-tests=error

echo "== Python package: pip install . (reusing build/, nothing recompiles) and pytest on the host backend"
python3 -m pip install -q --disable-pip-version-check --no-build-isolation -C build-dir=build . 2>/dev/null ||
  python3 -m pip install -q --disable-pip-version-check --no-build-isolation --break-system-packages \
    -C build-dir=build .
(cd build && python3 -c "import epx, sys; print('epx', epx.__version__, 'from', epx.__file__)" &&
  python3 -m pytest -q -p no:cacheprovider ../python/tests)

echo "== CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer (clang, host-only build with the fuzz targets)"
# One configuration for both: the sanitizer build is clang's, so it also builds the libFuzzer targets.
# A build-asan configured by an older test.sh (gcc) cannot switch compilers in place: start it afresh.
if [ -f build-asan/CMakeCache.txt ] && ! grep -q '^CMAKE_CXX_COMPILER:.*clang' build-asan/CMakeCache.txt; then
  rm -rf build-asan
fi
cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DEPX_CUDA=OFF -DEPX_WERROR=ON \
  -DEPX_BUILD_BENCH=OFF -DEPX_SANITIZE=address,undefined -DEPX_BUILD_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  >/dev/null
cmake --build build-asan -j "$jobs"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" --no-tests=error

echo "== fuzzing (libFuzzer, ${EPX_FUZZ_SECONDS:=30} s per target, all targets at once)"
EPX_FUZZ_BUILD_DIR=build-asan bash scripts/fuzz.sh "$EPX_FUZZ_SECONDS"

echo "== epx bench on the host backend"
./build/epx bench --host --quiet --warmup 1 --iters 3 --json build/bench-host.json

echo "== install and find_package(epx)"
rm -rf build/install-prefix build/consumer
cmake --install build --prefix build/install-prefix >/dev/null
cmake -S tests/install -B build/consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/install-prefix" >/dev/null
cmake --build build/consumer
./build/consumer/epx_consumer
echo "all checks passed"
