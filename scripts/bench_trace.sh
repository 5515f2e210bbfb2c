#!/usr/bin/env bash
# Issue 37 part 4: the bundled Mooncake-format trace replayed on `ferry up` and simulated by
# `ferry plan`, for 1 and 2 prefill workers (1 decode worker; one compute thread each): the cache
# hit rate Ferry reports against the one the trace's hash ids imply. Two replays per cluster, each
# from a cold cache (bench serve salts each trace replay): one request at a time (the oracle's
# assumption: each request finds what its predecessors left) and open loop at the trace's own
# pace times SCALE (requests that share a prefix may then overlap, and the second one computes
# the part the first has not finished). Then `ferry plan --trace` on the same trace.
# Usage: scripts/bench_trace.sh [OUT_DIR]   (FERRY: the binary [target/release/ferry]; BLOCK
#   tokens per hash id [64]; SCALE [1]; MAX_OUTPUT [32]; PROFILE for plan [a committed one])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/trace}"
mkdir -p "$out"
ferry="${FERRY:-./target/release/ferry}"
trace="${TRACE:-tests/fixtures/traces/mooncake_small.jsonl}"
block="${BLOCK:-64}" scale="${SCALE:-1}" max_output="${MAX_OUTPUT:-32}"
profile="${PROFILE:-docs/img/plan-validation-run4/profile-split-1c.json}"
replay=(--trace "$trace" --trace-block-tokens "$block" --trace-max-output "$max_output" --slo-ttft-ms 20000 --slo-tpot-ms 500)
for prefill in 1 2; do
    up_cluster "$ferry" "$out/up-${prefill}p1d.log" --threads 1 --prefill "$prefill" --decode 1
    "$ferry" bench serve --router "$ROUTER" "${replay[@]}" --trace-time-scale 0.01 --max-concurrency 1 \
        --label "${prefill}P:1D one at a time" --out "$out/${prefill}p1d-serial.json" | tee "$out/${prefill}p1d-serial.log"
    "$ferry" bench serve --router "$ROUTER" "${replay[@]}" --trace-time-scale "$scale" \
        --label "${prefill}P:1D open loop" --out "$out/${prefill}p1d-open.json" | tee "$out/${prefill}p1d-open.log"
    down_cluster
done
"$ferry" plan --profile "$profile" --splits 1:1,2:1 --rates 1 --trace "$trace" --trace-block-tokens "$block" \
    --trace-max-output "$max_output" | tee "$out/plan.log"
