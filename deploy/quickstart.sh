#!/usr/bin/env bash
# Installs dependencies, builds numoe and runs the main job on the built-in default:
# the CPU backend and the small trained model shipped in tests/data/demo-v4.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${NUMOE_MODEL:-tests/data/demo-v4}

./deploy/install-deps.sh
NUMOE_BUILD_DIR=build ./deploy/build.sh

echo
echo "== numoe inspect --model $MODEL =="
./build/bin/numoe inspect --model "$MODEL"

echo
echo "== numoe generate (one process, CPU backend) =="
./build/bin/numoe generate --model "$MODEL" --prompt "Q: What is the meaning of life?
A:" --max-new-tokens 48 --temperature 0.8 --seed 1
