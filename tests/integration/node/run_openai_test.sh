#!/usr/bin/env bash
# Checks numoe-router's REST API with the official `openai` npm client: two fake workers + the router, then
# openai_test.mjs (completions and chat completions, streaming and not, and an error case).
# Usage: run_openai_test.sh NUMOE_ROUTER FAKE_WORKER MODEL_DIR WORK_DIR
# Exit 77 (skipped) when node/npm is missing or the npm registry cannot be reached.
set -uo pipefail
abs() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
mkdir -p "$4"
ROUTER=$(abs "$1") FAKE=$(abs "$2") MODEL=$(abs "$3") WORK=$(cd "$4" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 77; }

# Install the client into the build tree (package.json pins the exact version).
want=$(node -e 'console.log(require(process.argv[1]).devDependencies.openai)' "$HERE/package.json")
have=$(node -e 'try{console.log(require(process.argv[1]).version)}catch{console.log("")}' \
         "$WORK/node_modules/openai/package.json")
if [ "$have" != "$want" ]; then
  cp "$HERE/package.json" "$WORK/package.json"
  if ! (cd "$WORK" && timeout 120 npm install --no-audit --no-fund --loglevel=error >"$WORK/npm-install.log" 2>&1); then
    echo "SKIP: 'npm install openai' failed (registry unreachable?):"; tail -5 "$WORK/npm-install.log"; exit 77
  fi
fi
cp "$HERE/openai_test.mjs" "$WORK/openai_test.mjs"

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
rm -f "$WORK"/*.ready
for i in 0 1; do
  "$FAKE" --model "$MODEL" --id "w$i" --port 0 --ready-file "$WORK/w$i.ready" --token-delay-ms 2 >"$WORK/w$i.log" 2>&1 &
  PIDS+=($!)
done
for i in 0 1; do
  for _ in $(seq 200); do [ -s "$WORK/w$i.ready" ] && break; sleep 0.05; done
  [ -s "$WORK/w$i.ready" ] || { echo "fake worker $i did not start"; cat "$WORK/w$i.log"; exit 1; }
done
W0=$(cat "$WORK/w0.ready") W1=$(cat "$WORK/w1.ready")
"$ROUTER" --model "$MODEL" --workers "127.0.0.1:$W0,127.0.0.1:$W1" --port 0 --grpc-port -1 \
  --ready-file "$WORK/router.ready" --health-interval 0.2 --api-key node-test-key >"$WORK/router.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do [ -s "$WORK/router.ready" ] && break; sleep 0.05; done
[ -s "$WORK/router.ready" ] || { echo "router did not start"; cat "$WORK/router.log"; exit 1; }
PORT=$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1])).http_port)' "$WORK/router.ready")
for _ in $(seq 200); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  node -e 'fetch(process.argv[1]).then(r=>process.exit(r.ok?0:1)).catch(()=>process.exit(1))' \
    "http://127.0.0.1:$PORT/health" && break
  sleep 0.05
done
cd "$WORK" && node openai_test.mjs "http://127.0.0.1:$PORT/v1" node-test-key
rc=$?
[ $rc -eq 0 ] || { echo "--- router log"; tail -30 "$WORK/router.log"; }
exit $rc
