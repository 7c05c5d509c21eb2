#!/usr/bin/env bash
# Checks numoe-router's REST API with an official npm client: two fake workers + the router, then one test
# script (openai_test.mjs: the `openai` client; anthropic_test.mjs: `@anthropic-ai/sdk`), which gets the
# router's root URL and API key (and, with tls, the CA file to trust).
# Usage: run_node_test.sh NUMOE_ROUTER FAKE_WORKER MODEL_DIR WORK_DIR TEST.mjs [tls]
# With tls, a self-signed certificate is made with the openssl command and the router serves HTTPS.
# package.json pins the clients' exact versions; they are installed into WORK_DIR (again when it changes).
# Exit 77 (skipped) when node/npm is missing or the npm registry cannot be reached.
set -uo pipefail
abs() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }
mkdir -p "$4"
ROUTER=$(abs "$1") FAKE=$(abs "$2") MODEL=$(abs "$3") WORK=$(cd "$4" && pwd) TEST=$5 TLS=${6:-}
HERE=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node/npm not installed"; exit 77; }

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
TLS_FLAGS=() SCHEME=http CA=
if [ "$TLS" = tls ]; then
  command -v openssl >/dev/null || { echo "SKIP: the openssl command is not installed"; exit 77; }
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 -subj /CN=localhost \
    -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" -keyout "$WORK/server.key" -out "$WORK/server.crt" \
    >"$WORK/openssl.log" 2>&1 || { echo "openssl failed"; cat "$WORK/openssl.log"; exit 1; }
  TLS_FLAGS=(--tls-cert "$WORK/server.crt" --tls-key "$WORK/server.key") SCHEME=https CA=$WORK/server.crt
fi
"$ROUTER" --model "$MODEL" --workers "127.0.0.1:$W0,127.0.0.1:$W1" --port 0 --grpc-port -1 "${TLS_FLAGS[@]}" \
  --ready-file "$WORK/router.ready" --health-interval 0.2 --api-key node-test-key >"$WORK/router.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do [ -s "$WORK/router.ready" ] && break; sleep 0.05; done
[ -s "$WORK/router.ready" ] || { echo "router did not start"; cat "$WORK/router.log"; exit 1; }
PORT=$(node -e 'console.log(JSON.parse(require("fs").readFileSync(process.argv[1])).http_port)' "$WORK/router.ready")
for _ in $(seq 200); do
  if [ -n "$CA" ]; then
    curl -sf --cacert "$CA" "https://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  else
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    node -e 'fetch(process.argv[1]).then(r=>process.exit(r.ok?0:1)).catch(()=>process.exit(1))' \
      "http://127.0.0.1:$PORT/health" && break
  fi
  sleep 0.05
done
cd "$WORK" && node "$TEST" "$SCHEME://127.0.0.1:$PORT" node-test-key $CA
rc=$?
[ $rc -eq 0 ] || { echo "--- router log"; tail -30 "$WORK/router.log"; }
exit $rc
