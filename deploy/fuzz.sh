#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) into ${NUMOE_FUZZ_BUILD_DIR:-build-fuzz}/ with clang, ASan + UBSan
# (cmake -DNUMOE_FUZZ=ON: only the fuzz targets and the libraries they call), then runs each for SECONDS
# (default 20) on a scratch copy of its committed seed corpus (tests/fuzz/corpus/<name>/, left untouched).
# Prints one line per target and exits non-zero on any finding: a crash, an ASan or UBSan report, a leak,
# an input slower than 10 s, or more than 2 GiB of memory. The input that found it is saved under
# build-fuzz/findings/ (rerun it with build-fuzz/bin/fuzz_<name> FILE; the log is next to it).
#
#   deploy/fuzz.sh [SECONDS] [NAME...]    e.g. deploy/fuzz.sh 60 config safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
SECONDS_EACH=${1:-20}
shift || true
if ! [[ "$SECONDS_EACH" =~ ^[0-9]+$ ]] || [ "$SECONDS_EACH" -lt 1 ]; then
  echo "fuzz.sh: SECONDS must be a positive integer (got '$SECONDS_EACH')" >&2
  exit 2
fi
BUILD_DIR=${NUMOE_FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${NUMOE_JOBS:-$(nproc)}
CC_BIN=${NUMOE_FUZZ_CC:-clang}
CXX_BIN=${NUMOE_FUZZ_CXX:-clang++}
for tool in "$CC_BIN" "$CXX_BIN"; do
  command -v "$tool" >/dev/null || { echo "fuzz.sh: $tool not found (deploy/install-deps.sh installs clang)" >&2; exit 2; }
done

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in tests/fuzz/fuzz_*.cc; do n=$(basename "$f" .cc); names+=("${n#fuzz_}"); done
fi
targets=()
for n in "${names[@]}"; do
  [ -f "tests/fuzz/fuzz_$n.cc" ] || { echo "fuzz.sh: no fuzz target '$n' (tests/fuzz/fuzz_$n.cc)" >&2; exit 2; }
  targets+=("fuzz_$n")
done

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" -DNUMOE_FUZZ=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

findings="$BUILD_DIR/findings"
mkdir -p "$findings"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/numoe-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
for n in "${names[@]}"; do
  corpus="$scratch/$n"
  mkdir -p "$corpus"
  if [ -d "tests/fuzz/corpus/$n" ]; then cp -R "tests/fuzz/corpus/$n/." "$corpus/"; fi
  seeds=$(find "$corpus" -type f | wc -l)
  log="$findings/fuzz_$n.log"
  rm -f "$findings/fuzz_$n"-*  # the findings of an earlier run
  start=$(date +%s)
  rc=0
  "$BUILD_DIR/bin/fuzz_$n" "$corpus" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$findings/fuzz_$n-" -print_final_stats=1 -print_funcs=0 >"$log" 2>&1 || rc=$?
  took=$(( $(date +%s) - start ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -aoE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  if [ "$rc" -eq 0 ]; then
    printf 'fuzz %-16s ok       %8s runs in %3ss, coverage %s, corpus %s -> %s inputs\n' "$n" "${runs:-?}" "$took" \
      "${cov:-?}" "$seeds" "$(find "$corpus" -type f | wc -l)"
  else
    failed=1
    what=$(grep -a -m1 -oE '(ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer): |runtime error: ).*' "$log" | cut -c1-140 || true)
    artifact=$(grep -a -m1 -oE "Test unit written to [^ ]+" "$log" | sed 's/Test unit written to //' || true)
    printf 'fuzz %-16s FINDING  exit %s after %ss: %s; input %s; log %s\n' "$n" "$rc" "$took" "${what:-see log}" \
      "${artifact:-none}" "$log"
  fi
done
exit $failed
