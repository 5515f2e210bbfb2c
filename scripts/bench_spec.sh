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
python3 - "$out" <<'PY'
import glob, json, sys, statistics
out = sys.argv[1]
for wl in ("copy", "random"):
    rows = {}
    for f in sorted(glob.glob(f"{out}/{wl}-*.json")):
        name = f.split("/")[-1][len(wl) + 1:].rsplit(".", 2)[0]
        for r in json.load(open(f))["runs"]:
            rows.setdefault((r["rate"], name), []).append(r)
    for (rate, name), rs in sorted(rows.items()):
        tpot = statistics.median(r["tpot_ms"]["p50"] for r in rs)
        tps = statistics.median(r["output_tok_per_s"] for r in rs)
        digests = sorted({r["outputs_digest"] for r in rs})
        print(f"{wl:6} rate {rate:4} {name:7} TPOT p50 {tpot:7.2f} ms  output {tps:7.1f} tok/s  runs {len(rs)}  digests {digests}")
PY
