#!/usr/bin/env bash
# Issue 36 after the q8 row-dot switch moved to 64 rows (and the AVX-512 VNNI kernel): speculation
# off, prompt lookup and suffix decoding on the copy workload at two rates: 0.1 req/s (one
# sequence decoding at a time: TPOT is the single stream's) and 4 req/s (all 8 requests within 2 s:
# the decode worker runs them as one batch, and its output tokens/s is what it serves). A step may
# now carry up to 64 rows, so a batch of 8 has room to verify 7 proposed tokens for each sequence.
# One prefill and one decode worker, one pinned core each, prefix cache off, as in
# scripts/bench_spec.sh; the configurations in turn, ROUNDS times; every run's `outputs_digest`
# must agree. FERRY_QUANT_SIMD=avx2 in the environment caps the decode kernels at AVX2.
# WORKLOAD=random runs scripts/bench_spec.sh's nothing-to-copy workload instead (random prompts,
# answers sampled at temperature 1 with a seed per request) at RATES (default 0.2,1). REQUESTS
# sets the copy workload's requests per rate (default 8). FERRY_QUANT_AMX=off keeps the decode
# kernels off AMX where the CPU has it. The summary's "while decoding" is the decode worker's
# output tokens/s over the time it held requests (scripts/lib/serve_summary.py).
# Usage: scripts/bench_spec_saturation.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/spec-saturation}"
mkdir -p "$out"
ferry="${FERRY:-./target/release/ferry}"
slo=(--seed 5 --slo-ttft-ms 60000 --slo-tpot-ms 200)
workload="${WORKLOAD:-copy}"
case "$workload" in
    copy) load=(--workload copy --requests "${REQUESTS:-8}" --output-len 400 --rates "${RATES:-0.1,4}") ;;
    random) load=(--workload random --temperature 1 --requests 8 --prompt-len 64..512 --output-len 128 --rates "${RATES:-0.2,1}") ;;
    *) echo "WORKLOAD is copy or random, not $workload" >&2; exit 2 ;;
esac

for round in $(seq 1 "${ROUNDS:-2}"); do
    for spec in ${SPECS:-off ngram suffix}; do
        echo "== round $round: speculation $spec"
        up_cluster "$ferry" "$out/$workload-$spec.$round.up.log" --threads 1 --pin --no-prefix-cache --prefill 1 --decode 1 --speculate "$spec"
        "$ferry" bench serve --router "$ROUTER" "${load[@]}" "${slo[@]}" --label "$workload $spec" --out "$out/$workload-$spec.$round.json"
        down_cluster
    done
done
python3 scripts/lib/serve_summary.py "$out" "$workload"
