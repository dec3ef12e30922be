#!/usr/bin/env bash
# Builds the C++ self-test and the kernel library with -fsanitize=address,undefined and
# runs the self-test (exit status = test result).  Usage: csrc/tests/run_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${QDSL_SAN_DIR:-$(mktemp -d)}"
mkdir -p "$OUT"
SRCS=$(find . -name '*.cc' -not -path './tests/*' -not -path './bindings/*')
FLAGS="-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined -Iinclude -I."
# shellcheck disable=SC2086
${CXX:-g++} $FLAGS $SRCS tests/test_main.cc -pthread -o "$OUT/qdsl_selftest"
"$OUT/qdsl_selftest"
