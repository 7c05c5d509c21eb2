#!/usr/bin/env bash
# Installs dependencies, builds numoe and runs the whole test suite; exits non-zero on any failure.
#   1. the main tree (build/): every test label (unit, kernels, model, integration; gpu skips without a GPU)
#   2. a sanitizer tree (build-asan/): the loader and tokenizer unit tests under ASan + UBSan
#   3. the fuzz tree (build-fuzz/, clang): every libFuzzer target of tests/fuzz/ for NUMOE_FUZZ_SECONDS (15) each
set -euo pipefail
cd "$(dirname "$0")/.."

./deploy/install-deps.sh
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}

echo "== build (RelWithDebInfo) =="
NUMOE_BUILD_DIR=build ./deploy/build.sh
echo "== tests =="
ctest --test-dir build --output-on-failure -j 2

echo "== build (ASan + UBSan, unit tests only) =="
NUMOE_BUILD_DIR=build-asan NUMOE_BUILD_TYPE=Debug ./deploy/build.sh -DNUMOE_SANITIZE=ON -DNUMOE_ONLY_UNIT=ON
echo "== tests under ASan + UBSan =="
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j 2 -L unit

echo "== fuzz targets (clang, ASan + UBSan, ${NUMOE_FUZZ_SECONDS:-15} s each) =="
./deploy/fuzz.sh "${NUMOE_FUZZ_SECONDS:-15}"
