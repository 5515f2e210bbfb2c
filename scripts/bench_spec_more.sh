#!/usr/bin/env bash
# Issue 36's second experiment (after scripts/bench_spec.sh): more rounds of the workload with
# nothing to copy (random prompts, answers sampled at temperature 1), to resolve a few percent
# through this machine's drift, and the copy workload at a rate that saturates the decode worker
# (its output tokens/s is then what one decode worker serves). Same cluster as bench_spec.sh.
# Usage: scripts/bench_spec_more.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/spec-more}"
mkdir -p "$out"
ferry=./target/release/ferry
slo=(--seed 5 --slo-ttft-ms 60000 --slo-tpot-ms 200)

run() {
    local name="$1" round="$2"; shift 2
    up_cluster "$ferry" "$out/$name.$round.up.log" --threads 1 --pin --no-prefix-cache --prefill 1 --decode 1 "$@"
    "$ferry" bench serve --router "$ROUTER" --workload random --temperature 1 --requests 8 --prompt-len 64..512 --output-len 128 --rates 0.2,1 "${slo[@]}" --label "random $name" --out "$out/random-$name.$round.json"
    "$ferry" bench serve --router "$ROUTER" --workload copy --requests 8 --output-len 400 --rates 4 "${slo[@]}" --label "copy $name" --out "$out/copy-$name.$round.json"
    down_cluster
}

for round in $(seq 1 "${ROUNDS:-3}"); do
    run off "$round"
    run ngram "$round" --speculate ngram
    run suffix "$round" --speculate suffix
done
python3 scripts/lib/serve_summary.py "$out" random copy
