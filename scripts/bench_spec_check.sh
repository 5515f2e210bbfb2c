#!/usr/bin/env bash
# Issue 36: the nothing-to-copy workload alone, speculation (ngram) and off in turn, printing each
# run's TPOT p50, outputs digest and the decode worker's speculation counters and step time (its
# /metrics), to tell what speculation costs from what the machine does.
# Usage: scripts/bench_spec_check.sh   (build first: cargo build --release -p ferry)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
mkdir -p target/spec-check
ferry=./target/release/ferry
for cfg in ngram off ngram off ngram off; do
  flags=(); [ $cfg = ngram ] && flags=(--speculate ngram)
  up_cluster $ferry target/spec-check/run.$cfg.log --threads 1 --pin --no-prefix-cache --prefill 1 --decode 1 "${flags[@]}"
  $ferry bench serve --router $ROUTER --workload random --temperature 1 --requests 8 --prompt-len 64..512 --output-len 128 --rates 0.2 --seed 5 --out target/spec-check/run.$cfg.json > /dev/null 2>&1
  m=$(grep 'role=decode' target/spec-check/run.$cfg.log | grep -o 'metrics=[0-9.:]*' | cut -d= -f2 | head -1)
  echo "$cfg $(python3 -c "import json;r=json.load(open('target/spec-check/run.$cfg.json'))['runs'][0];print(round(r['tpot_ms']['p50'],2), r['outputs_digest'])") $(curl -s http://$m/metrics | grep -E '^ferry_worker_spec|^ferry_worker_step_seconds_(sum|count)' | tr '\n' ' ')"
  down_cluster
done
