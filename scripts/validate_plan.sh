#!/usr/bin/env bash
# Issue #19's validation: predict with `ferry plan`, then measure with `ferry bench serve`, on this
# machine, for several splits at several rates, and print the predicted-vs-measured table.
#
# 1. `ferry profile` measures one worker's step costs (one thread pinned to core 0, as the
#    workers below run: `ferry up --threads 1 --pin`).
# 2. For each split, a `ferry up` cluster of it (prefix caches off: every rate replays the same
#    prompts, and the simulation has no cache) serves the same seeded `bench serve` workload at
#    each rate (results in OUT/<split>.json).
# 3. `ferry plan --measured` predicts every (split, rate) cell from the profile with the workload,
#    seed and SLOs recorded in those files, and prints the errors.
#
# Usage: scripts/validate_plan.sh [OUT_DIR]   (build first: cargo build -p ferry)
# Knobs: FERRY (binary), SPLITS ("1:1 2c 1c"), RATES, REQUESTS, PROMPT_LEN, OUTPUT_LEN,
#        SLO_TTFT_MS, SLO_TPOT_MS, PROFILE (reuse a profile instead of measuring one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-target/validate-plan}"
mkdir -p "$out"
ferry="${FERRY:-./target/debug/ferry}"
splits=(${SPLITS:-1:1 2c 1c})
load=(--requests "${REQUESTS:-20}" --prompt-len "${PROMPT_LEN:-32..512}" --output-len "${OUTPUT_LEN:-32..96}" --seed 7
      --rates "${RATES:-0.2,0.4,0.6}" --slo-ttft-ms "${SLO_TTFT_MS:-5000}" --slo-tpot-ms "${SLO_TPOT_MS:-45}")

profile="${PROFILE:-$out/profile.json}"
if [ -z "${PROFILE:-}" ]; then
    pin=()
    command -v taskset > /dev/null && pin=(taskset -c 0)
    "${pin[@]}" "$ferry" profile --model default --threads 1 --out "$profile" ${PROFILE_ARGS:-}
fi

measured=()
for split in "${splits[@]}"; do
    case "$split" in
        *:*) pools=(--prefill "${split%%:*}" --decode "${split##*:}") ;;
        *c) pools=(--prefill 0 --decode 0 --colocated "${split%c}") ;;
        *) echo "bad split $split (P:D or Nc)" >&2; exit 1 ;;
    esac
    label="split-${split/:/p}"
    log="$out/$label.up.log"
    "$ferry" up --listen 127.0.0.1:0 --http 127.0.0.1:0 --threads 1 --pin --no-prefix-cache "${pools[@]}" > "$log" 2>&1 &
    up=$!
    router=""
    for _ in $(seq 1 600); do
        router="$(grep -o 'ready router=[0-9.:]*' "$log" | cut -d= -f2 || true)"
        [ -n "$router" ] && break
        sleep 0.2
    done
    [ -n "$router" ] || { echo "$split: cluster did not start (see $log)" >&2; kill "$up"; exit 1; }
    echo "== $split: bench serve against $router" >&2
    "$ferry" bench serve --router "$router" "${load[@]}" --label "$split" --out "$out/$label.json"
    kill -TERM "$up"; wait "$up" || true
    measured+=("$split=$out/$label.json")
done

"$ferry" plan --profile "$profile" --measured "$(IFS=,; echo "${measured[*]}")" | tee "$out/validation.md"
"$ferry" plan --profile "$profile" --measured "$(IFS=,; echo "${measured[*]}")" --json > "$out/validation.json"
echo "results in $out" >&2
