#!/usr/bin/env bash
# Configures and builds numoe into ${NUMOE_BUILD_DIR:-build} with Ninja (ccache when present).
# Extra arguments go to cmake's configure step, e.g. -DNUMOE_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${NUMOE_BUILD_DIR:-build}
JOBS=${NUMOE_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${NUMOE_BUILD_TYPE:-RelWithDebInfo} "$@" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
