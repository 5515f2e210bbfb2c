#!/usr/bin/env bash
# Issue 36's experiment: speculative decoding on vs off, the same seeded workloads, one prefill
# and one decode worker (one pinned core each, prefix cache off so that no answer depends on
# when a prefix was cached), speculation on the decode worker only. Two workloads: `copy`
# (greedy answers that copy from their prompt: code edits, quotes, JSON reformatting) and
# `random` (random prompts, answers sampled at temperature 1 with a seed per request: nothing
# to copy, and no greedy loop to predict either). The configurations run in turn, ROUNDS times,
# so the machine's drift falls on all of them; each run's `outputs_digest` must agree across
# them.
# Usage: scripts/bench_spec.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/spec}"
mkdir -p "$out"
ferry=./target/release/ferry
copy=(--workload copy --requests "${REQUESTS:-8}" --output-len "${COPY_LEN:-400}" --rates "${COPY_RATES:-0.1,0.5}")
random=(--workload random --temperature 1 --requests "${REQUESTS:-8}" --prompt-len 64..512 --output-len "${RANDOM_LEN:-128}" --rates "${RANDOM_RATES:-0.2,1}")
slo=(--seed 5 --slo-ttft-ms 20000 --slo-tpot-ms 200)

run() {
    local name="$1" round="$2"; shift 2
    up_cluster "$ferry" "$out/$name.$round.up.log" --threads 1 --pin --no-prefix-cache --prefill 1 --decode 1 "$@"
    "$ferry" bench serve --router "$ROUTER" "${copy[@]}" "${slo[@]}" --label "copy $name" --out "$out/copy-$name.$round.json" --save-outputs "$out/copy-$name.$round.jsonl"
    "$ferry" bench serve --router "$ROUTER" "${random[@]}" "${slo[@]}" --label "random $name" --out "$out/random-$name.$round.json" --save-outputs "$out/random-$name.$round.jsonl"
    down_cluster
}

for round in $(seq 1 "${ROUNDS:-2}"); do
    run off "$round"
    run ngram "$round" --speculate ngram
    run suffix "$round" --speculate suffix
done
python3 scripts/lib/serve_summary.py "$out" copy random
