#!/usr/bin/env bash
# Builds the kernel library with -fsanitize=address,undefined and runs
#   1. the C++ self-test (csrc/tests/test_main.cc), and
#   2. unless --cpp-only, the Python runtime tests (tests/runtime) against the sanitized
#      shared library (QDSL_RUNTIME_LIB + LD_PRELOAD of the sanitizer runtimes), which
#      covers the .qgraph loader fuzzing and every graph op.
# Exit status: nonzero on any sanitizer report or test failure.
# Usage: csrc/tests/run_sanitizers.sh [--cpp-only]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${QDSL_SAN_DIR:-$(mktemp -d)}"
mkdir -p "$OUT"
CXX="${CXX:-g++}"
SRCS=$(find . -name '*.cc' -not -path './tests/*')
FLAGS="-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined -Iinclude -I."
# shellcheck disable=SC2086
$CXX $FLAGS $SRCS tests/test_main.cc -pthread -o "$OUT/qdsl_selftest"
"$OUT/qdsl_selftest"
if [[ "${1:-}" == "--cpp-only" ]]; then
  exit 0
fi
# shellcheck disable=SC2086
$CXX $FLAGS -fPIC -shared $SRCS -pthread -o "$OUT/libqdsl_asan.so"
PRELOAD="$($CXX -print-file-name=libasan.so):$($CXX -print-file-name=libubsan.so)"
cd ..
# Python itself leaks by design at exit: leak checking off, everything else on.
ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$PRELOAD" QDSL_RUNTIME_LIB="$OUT/libqdsl_asan.so" \
  python -m pytest -q -p no:cacheprovider tests/runtime
