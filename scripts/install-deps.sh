#!/usr/bin/env bash
# Installs what epx needs to build and test: Debian packages by name, and the Python build/test packages
# from PyPI for the python3 on PATH. Idempotent; needs root (or sudo) for the Debian packages.
set -euo pipefail
# clang + libclang-rt-dev (its sanitizer and libFuzzer runtimes, only recommended by clang): the sanitizer and
# fuzz build of scripts/test.sh and scripts/fuzz.sh.
pkgs=(cmake ninja-build g++ clang libclang-rt-dev libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
  libfmt-dev libspdlog-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python package: nanobind + scikit-build-core build it; numpy, ml_dtypes and pytest test it.
if ! python3 -m pip --version >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-pip python3-dev
fi
py_pkgs=(nanobind scikit-build-core numpy ml_dtypes pytest matplotlib)
if ! python3 -c "import nanobind, scikit_build_core, numpy, ml_dtypes, pytest, matplotlib" >/dev/null 2>&1; then
  # Debian's own python3 refuses pip installs outside a venv (PEP 668) unless told otherwise.
  python3 -m pip install -q --disable-pip-version-check "${py_pkgs[@]}" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --break-system-packages "${py_pkgs[@]}"
fi
