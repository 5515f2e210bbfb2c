#!/usr/bin/env bash
# Issue 17's benchmark on one machine: the same seeded multi-turn chat workload (a shared system
# prompt, users x turns, each turn = the last prompt + its answer + a new message, think time
# between turns) through `ferry up` (1 prefill + 2 decode workers) with
#   off       the prefix cache off (--no-prefix-cache)
#   load      the cache on, routing on load alone (--prefix-routing load)
#   kv-remote the cache on, KV-aware routing, every prompt prefilled on the prefill worker
#             (--local-prefill-max 0: a decode worker holding the conversation receives only the
#             blocks it lacks)
#   kv        the cache on, KV-aware routing, short suffixes computed on the decode worker that
#             holds the conversation (the default --local-prefill-max)
# then a workload with no shared prefixes (random prompts) with the cache off and on, for the
# cache's overhead. Prints each run's tables; writes JSON and a TTFT-by-turn plot to OUT_DIR.
# Usage: scripts/bench_prefix.sh [OUT_DIR]   (build first: cargo build --release -p ferry)
# RUNS="off kv" runs only those (the plot then draws the multi-turn ones that ran); RATES,
# RANDOM_RATES, USERS, TURNS, SYSTEM_TOKENS, USER_TOKENS, OUTPUT_LEN, THINK_MS, REQUESTS and
# PROMPT_LEN change the workloads.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/bench-prefix}"
mkdir -p "$out"
ferry=./target/release/ferry
multiturn=(--workload multiturn --users "${USERS:-12}" --turns "${TURNS:-4}" --system-tokens "${SYSTEM_TOKENS:-300}"
           --user-tokens "${USER_TOKENS:-20..60}" --output-len "${OUTPUT_LEN:-32}" --think-ms "${THINK_MS:-1000}"
           --rates "${RATES:-0.5}" --seed 7)
random=(--workload random --requests "${REQUESTS:-40}" --prompt-len "${PROMPT_LEN:-64..512}" --output-len 32..64
        --rates "${RANDOM_RATES:-0.6}" --seed 7)

runs="${RUNS:-off load kv-remote kv random-off random-on}"
run() {
    local label="$1" load_args="$2"; shift 2
    case " $runs " in *" $label "*) ;; *) return 0 ;; esac
    up_cluster "$ferry" "$out/$label.up.log" --prefill 1 --decode 2 --threads 1 "$@"
    echo "== $label ($*)"
    # shellcheck disable=SC2086
    "$ferry" bench serve --router "$ROUTER" $load_args --label "$label" --out "$out/$label.json"
    down_cluster
}

mt="${multiturn[*]}"
run off "$mt" --no-prefix-cache
run load "$mt" --prefix-routing load
run kv-remote "$mt" --local-prefill-max 0
run kv "$mt"
rnd="${random[*]}"
run random-off "$rnd" --no-prefix-cache
run random-on "$rnd"
# One TTFT-by-turn plot of the multi-turn runs (reads the JSON files; sends no requests).
plotted=()
for label in off load kv-remote kv; do
    case " $runs " in *" $label "*) plotted+=("$out/$label.json") ;; esac
done
[ "${#plotted[@]}" -eq 0 ] || "$ferry" bench plot "${plotted[@]}" --out "$out/ttft_by_turn.svg"
echo "results and plot in $out"
