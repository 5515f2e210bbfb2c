#!/usr/bin/env bash
# Issue 36: what speculation costs when there is nothing to copy, measured so that the machine's
# drift cancels. Two clusters run at the same time on the same requests, one with speculation off
# and one with it on, each pinned whole (router, prefill and decode worker) to one of the two
# cores, and then again with the cores swapped; each request's TPOT with speculation is held
# against the same request's without it, served in the same seconds. After each run the script
# reads both decode workers' /metrics: the step time, the speculation counters (proposed,
# accepted) and `ferry_worker_spec_seconds` (time spent speculating outside the forward pass).
# The workload (WORKLOAD) is scripts/bench_spec.sh's random one (random prompts of 64-512 tokens,
# 128 tokens sampled at temperature 1 with a seed per request: nothing to copy), or `sharegpt`:
# ShareGPT's first human turns (scripts/bench_sharegpt.sh's file, fetched with pip), answers of
# the dataset's length up to 128 tokens, sampled the same way. Both clusters' outputs must agree
# (the summary prints their digests). The summary's plot:
# OUT_DIR/spec_overhead_WORKLOAD.svg.
# Needs two CPUs (taskset -c 0 and 1). Env: FERRY (binary), ROUNDS (2), SPECS ("ngram suffix"),
# RATES (0.2,1), REQUESTS (12 per rate).
# Usage: scripts/bench_spec_overhead.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
. scripts/lib/sharegpt.sh
out="${1:-target/spec-overhead}"
mkdir -p "$out"
ferry="$(realpath "${FERRY:-./target/release/ferry}")"
for core in 0 1; do
    printf '#!/bin/sh\nexec taskset -c %s %s "$@"\n' "$core" "$ferry" > "$out/ferry-core$core"
    chmod +x "$out/ferry-core$core"
done
rates="${RATES:-0.2,1}" requests="${REQUESTS:-12}"
case "${WORKLOAD:-random}" in
    random) load=(--workload random --prompt-len 64..512 --output-len 128) ;;
    sharegpt)
        # Chat prompts as people wrote them (scripts/bench_sharegpt.sh's file), answers capped at 128.
        sharegpt_jsonl "$out" "$rates" "$requests" 128 0
        load=(--dataset "$out/sharegpt.jsonl") ;;
    *) echo "WORKLOAD is random or sharegpt, not $WORKLOAD" >&2; exit 2 ;;
esac
load+=(--temperature 1 --requests "$requests" --rates "$rates" --seed 5 --slo-ttft-ms 60000 --slo-tpot-ms 200)

# Prints the decode worker's counters named by the summary, one `name value` per line.
scrape() {
    local m
    m="$(grep 'role=decode' "$1" | grep -o 'metrics=[0-9.:]*' | cut -d= -f2 | head -n1)"
    curl -s "http://$m/metrics" | grep -E '^ferry_worker_(spec_[a-z_]+|step_seconds_(sum|count)|generation_tokens_total)[{ ]' || true
}

for round in $(seq 1 "${ROUNDS:-2}"); do
    for spec in ${SPECS:-ngram suffix}; do
        for off_core in 0 1; do
            spec_core=$((1 - off_core))
            tag="$spec.$round.off$off_core"
            echo "== round $round: off on core $off_core, $spec on core $spec_core"
            up_cluster "$out/ferry-core$off_core" "$out/$tag.off.up.log" --threads 1 --no-prefix-cache --prefill 1 --decode 1 --speculate off
            off_pid=$UP_PID off_router=$ROUTER off_token="${FERRY_ADMIN_TOKEN:-}"
            up_cluster "$out/ferry-core$spec_core" "$out/$tag.spec.up.log" --threads 1 --no-prefix-cache --prefill 1 --decode 1 --speculate "$spec"
            spec_pid=$UP_PID spec_router=$ROUTER spec_token="${FERRY_ADMIN_TOKEN:-}"
            FERRY_ADMIN_TOKEN="$off_token" "$ferry" bench serve --router "$off_router" "${load[@]}" --label off --out "$out/$tag.off.json" > "$out/$tag.off.log" 2>&1 &
            a=$!
            FERRY_ADMIN_TOKEN="$spec_token" "$ferry" bench serve --router "$spec_router" "${load[@]}" --label "$spec" --out "$out/$tag.spec.json" > "$out/$tag.spec.log" 2>&1 &
            b=$!
            wait "$a"
            wait "$b"
            scrape "$out/$tag.off.up.log" > "$out/$tag.off.metrics"
            scrape "$out/$tag.spec.up.log" > "$out/$tag.spec.metrics"
            down_cluster "$off_pid" "$spec_pid"
        done
    done
done
python3 scripts/lib/spec_overhead_summary.py "$out" "$out/spec_overhead_${WORKLOAD:-random}.svg"
