#!/usr/bin/env bash
# Issue 35's capacity experiment: what a smaller KV type buys when the decode worker's KV memory
# is what binds. One prefill and one decode worker (one pinned core each), both with the same
# --kv-memory, long prompts and long answers, the same seeded open-loop workload for each KV
# dtype; the decode worker admits as many sequences as its blocks hold (f32 ~1, f16 ~2,
# int8 ~3.8x f32 at the default 128 MiB), and the rest wait for room.
# Usage: scripts/bench_kv_capacity.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/kv-capacity}"
mkdir -p "$out"
ferry=./target/release/ferry
load=(--requests "${REQUESTS:-10}" --prompt-len "${PROMPT_LEN:-1024}" --output-len "${OUTPUT_LEN:-1024}" --seed 11
      --rates "${RATES:-0.1,0.2}" --slo-ttft-ms "${SLO_TTFT_MS:-20000}" --slo-tpot-ms "${SLO_TPOT_MS:-100}")

run() {
    local dtype="$1"; shift
    up_cluster "$ferry" "$out/$dtype.up.log" --threads 1 --pin --kv-memory "${KV_MEMORY:-128MiB}" --kv-dtype "$dtype" "$@"
    "$ferry" bench serve --router "$ROUTER" "${load[@]}" --label "kv $dtype" --out "$out/$dtype.json"
    down_cluster
}

for dtype in ${DTYPES:-f32 int8 f16}; do
    run "$dtype" --prefill 1 --decode 1
done
set -- $(for d in ${DTYPES:-f32 int8 f16}; do echo "$out/$d.json"; done)
"$ferry" bench plot "$@" --out "$out/latency_vs_rate.svg"
echo "results and plot in $out"
