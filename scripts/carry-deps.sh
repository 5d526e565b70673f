#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what scripts/gpu-check.sh needs on the GPU machine, which has no
# Debian -dev packages and no internet: the headers, CMake configs and libraries of the build/test
# dependencies (copied from this Debian machine after scripts/install-deps.sh), and optionally the tests/
# of a DeepEP V1 checkout for the compatibility suites, and DeepEP V2's tests/elastic and deep_ep/utils (its test
# helpers, for scripts/deepep-v2-env.sh): scripts/carry-deps.sh [path/to/DeepEP.git [V1 tag [V2 revision]]].
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.carry/deps
rm -rf "$dest" && mkdir -p "$dest"
for pkg in libfmt-dev libspdlog-dev nlohmann-json3-dev libcli11-dev libgtest-dev; do
  dpkg -L "$pkg" | grep -E '^/usr/(include|lib|share/cmake)/' | while read -r f; do
    [ -f "$f" ] || continue
    mkdir -p "$dest/$(dirname "${f#/usr/}")"
    cp -aL "$f" "$dest/${f#/usr/}"
  done
done
# The CMake configs check that the shared libraries they name exist (from the runtime packages).
cp -aL /usr/lib/x86_64-linux-gnu/libfmt.so.* /usr/lib/x86_64-linux-gnu/libspdlog.so.* "$dest/lib/x86_64-linux-gnu/"
if [ $# -ge 1 ]; then
  rm -rf .carry/DeepEP && mkdir -p .carry/DeepEP
  git -C "$1" archive "${2:-v1.2.1}" tests | tar -x -C .carry/DeepEP
  rm -rf .carry/DeepEP-v2 && mkdir -p .carry/DeepEP-v2
  git -C "$1" archive "${3:-HEAD}" tests/elastic deep_ep/utils | tar -x -C .carry/DeepEP-v2
fi
du -sh .carry/*
