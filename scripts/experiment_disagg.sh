#!/usr/bin/env bash
# Issue #4's experiment on one 2-core machine: the same total compute (one core per worker,
# pinned) as (1) disaggregated: 1 prefill + 1 decode worker; (2) colocated: 2 colocated workers;
# (3) colocated with chunked prefill. The same seeded workload drives each through its router.
# Usage: scripts/experiment_disagg.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/experiment}"
mkdir -p "$out"
ferry=./target/release/ferry
load=(--requests "${REQUESTS:-12}" --prompt-len "${PROMPT_LEN:-32..512}" --output-len "${OUTPUT_LEN:-32..96}" --seed 7
      --rates "${RATES:-0.15,0.3,0.5}" --slo-ttft-ms "${SLO_TTFT_MS:-5000}" --slo-tpot-ms "${SLO_TPOT_MS:-45}")

run() {
    local label="$1"; shift
    up_cluster "$ferry" "$out/$label.up.log" --threads 1 --pin "$@"
    "$ferry" bench serve --router "$ROUTER" "${load[@]}" --label "$label" --out "$out/$label.json"
    down_cluster
}

run disaggregated --prefill 1 --decode 1
run colocated --prefill 0 --decode 0 --colocated 2
run colocated-chunked --prefill 0 --decode 0 --colocated 2 --chunked-prefill 64
# One plot of all three (reads the JSON files; sends no requests).
"$ferry" bench plot "$out/disaggregated.json" "$out/colocated.json" "$out/colocated-chunked.json" --out "$out/latency_vs_rate.svg"
echo "results and plot in $out"
