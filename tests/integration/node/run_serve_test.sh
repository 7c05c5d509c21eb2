#!/usr/bin/env bash
# Drives `numoe serve` (the real CPU backend) with the official `openai` npm client: sampling_test.mjs
# (logprobs against the goldens, n, penalties, logit_bias, min_p; the default) or structured_test.mjs
# (response_format and forced tool calls).
# Usage: run_serve_test.sh NUMOE_BIN MODEL_DIR WORK_DIR [TEST.mjs]
# Exit 77 (skipped) when node/npm is missing or the npm registry cannot be reached.
set -uo pipefail
abs() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
mkdir -p "$3"
NUMOE=$(abs "$1") MODEL=$(cd "$2" && pwd) WORK=$(cd "$3" && pwd) TEST=${4:-sampling_test.mjs}
HERE=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 77; }

# package.json pins the clients' exact versions; they are installed into WORK_DIR (again when it changes).
if ! cmp -s "$HERE/package.json" "$WORK/package.json" || [ ! -d "$WORK/node_modules" ]; then
  rm -rf "$WORK/node_modules" "$WORK/package-lock.json"
  cp "$HERE/package.json" "$WORK/package.json"
  if ! (cd "$WORK" && timeout 180 npm install --no-audit --no-fund --loglevel=error >"$WORK/npm-install.log" 2>&1); then
    echo "SKIP: 'npm install' of the clients failed (registry unreachable?):"; tail -5 "$WORK/npm-install.log"
    rm -f "$WORK/package.json"  # try again next time
    exit 77
  fi
fi
cp "$HERE/$TEST" "$WORK/$TEST"

free_port() { node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }
PORT=$(free_port) GRPC=$(free_port)
"$NUMOE" serve --model "$MODEL" --workers 1 --no-numa-bind --backend cpu --threads-per-worker 1 \
  --port "$PORT" --grpc-port "$GRPC" >"$WORK/serve.out" 2>"$WORK/serve.log" &
SERVE=$!
cleanup() { kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null; }
trap cleanup EXIT
for _ in $(seq 1200); do
  [ -s "$WORK/serve.out" ] && break
  kill -0 "$SERVE" 2>/dev/null || break
  sleep 0.1
done
grep -q "ready" "$WORK/serve.out" 2>/dev/null || { echo "numoe serve did not start"; tail -30 "$WORK/serve.log"; exit 1; }
cd "$WORK" && node "$TEST" "http://127.0.0.1:$PORT/v1" "$MODEL/golden.safetensors"
rc=$?
[ $rc -eq 0 ] || { echo "--- serve log"; tail -40 "$WORK/serve.log"; }
exit $rc
