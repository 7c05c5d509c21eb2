#!/usr/bin/env bash
# Installs dependencies, builds numoe and runs the main job on the built-in default: the CPU backend
# and the small trained model shipped in tests/data/demo-v4. It inspects the model, generates in one
# process, then starts the served stack (numoe serve: numoe-gpu + workers + numoe-router), sends one
# streamed chat request with curl and keeps serving until Ctrl-C.
#   NUMOE_MODEL=DIR   another checkpoint
#   NUMOE_PORT=N      REST port (default 8000; gRPC on N+1)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${NUMOE_MODEL:-tests/data/demo-v4}
PORT=${NUMOE_PORT:-8000}

./deploy/install-deps.sh
NUMOE_BUILD_DIR=build ./deploy/build.sh

echo
echo "== numoe inspect --model $MODEL =="
./build/bin/numoe inspect --model "$MODEL"

echo
echo "== numoe generate (one process, CPU backend) =="
./build/bin/numoe generate --model "$MODEL" --prompt "Q: What is the meaning of life?
A:" --max-new-tokens 48 --temperature 0.8 --seed 1

echo
echo "== numoe serve --model $MODEL =="
READY=$(mktemp)
./build/bin/numoe serve --model "$MODEL" --port "$PORT" --grpc-port $((PORT + 1)) > "$READY" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null; rm -f "$READY"' EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 600); do
  grep -q "ready" "$READY" && break
  kill -0 $SERVE 2>/dev/null || { echo "numoe serve exited before it was ready" >&2; exit 1; }
  sleep 0.5
done
cat "$READY"

echo
echo "== a streamed chat request =="
curl -sN "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'"$(basename "$MODEL")"'", "messages": [{"role": "user", "content": "Tell me a fortune."}],
       "max_tokens": 48, "temperature": 0.8, "seed": 1, "stream": true}'
echo
echo "numoe is serving on http://127.0.0.1:$PORT/v1 (OpenAI API) and 127.0.0.1:$((PORT + 1)) (gRPC); Ctrl-C stops it."
wait $SERVE
