#!/usr/bin/env bash
# Issue #19's validation: predict with `ferry plan`, then measure with `ferry bench serve`, on this
# machine, for several splits at several rates, and print the predicted-vs-measured table.
#
# For each split:
# 1. `ferry profile` measures one worker's step costs, one thread pinned to core 0 as the workers
#    below run (`ferry up --threads 1 --pin`), walking its grid in several passes. Just before
#    the split's measurement: this VM's speed drifts by up to ~1.7x over tens of minutes (the
#    same profile measured at 10:28 and 10:40 on 2026-12-03: prefill 6.4 against 10.6 ms a
#    token), so a profile from the start of a long run would price the last split at another
#    machine's speed.
# 2. A `ferry up` cluster of the split (prefix caches off: every rate replays the same prompts,
#    and the simulation has no cache) serves the same seeded `bench serve` workload at each rate
#    (results in OUT/split-*.json, each request recorded).
# Then `ferry plan --measured SPLIT=RESULT@PROFILE,...` predicts every (split, rate) cell from
# the profile measured before it, with the workload, seed and SLOs recorded in the result, and
# prints the errors (and, per request, the median of measured / predicted TTFT and TPOT); and
# again at the step time the workers measured during each rate (they price every step against
# the profile, `--profile`): the simulator's error with the machine's drift taken out.
#
# Usage: scripts/validate_plan.sh [OUT_DIR]   (build first: cargo build -p ferry)
# Knobs: FERRY (binary), SPLITS ("1:1 2c 1c"), RATES, REQUESTS, PROMPT_LEN, OUTPUT_LEN,
#        RATES_<split> (one split's rates, the colon as p: RATES_1p1=0.1,0.2, RATES_1c=0.05,0.08),
#        SLO_TTFT_MS, SLO_TPOT_MS, PROFILE_ARGS (extra `ferry profile` flags), PROFILE (one
#        profile for every split instead of measuring one before each), MODEL (the workers'
#        model, `default`), EMULATE (a profile the workers emulate, `--emulate-profile`, and the
#        plan predicts from: the simulator checked against Ferry's router and workers with the
#        machine's drift taken out; use a small MODEL, e.g. tests/fixtures/golden/llama-gqa, and
#        prompts that fit it: PROMPT_LEN=32..384), PROFILE_EVERY (`split`, the default: one profile
#        and one cluster per split; `rate`: a profile and a fresh cluster before every rate, so
#        that each cell is predicted from a profile measured minutes before it, not up to 20).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-target/validate-plan}"
mkdir -p "$out"
ferry="${FERRY:-./target/debug/ferry}"
splits=(${SPLITS:-1:1 2c 1c})
load=(--requests "${REQUESTS:-20}" --prompt-len "${PROMPT_LEN:-32..512}" --output-len "${OUTPUT_LEN:-32..96}" --seed 7
      --slo-ttft-ms "${SLO_TTFT_MS:-5000}" --slo-tpot-ms "${SLO_TPOT_MS:-45}")

# Profile (unless PROFILE or EMULATE gives one), start a cluster of the split (`pools`), serve
# the rates, stop it; appends SPLIT=RESULT@PROFILE to `measured`.
measure() {
    local split="$1" label="$2" rates="$3"
    local profile="${EMULATE:-${PROFILE:-$out/profile-$label.json}}"
    local emulate=()
    [ -n "${EMULATE:-}" ] && emulate=(--emulate-profile "$EMULATE")
    if [ -z "${PROFILE:-}${EMULATE:-}" ]; then
        echo "== $split ($label): profiling" >&2
        # shellcheck disable=SC2086
        taskset -c 0 "$ferry" profile --model default --threads 1 --out "$profile" ${PROFILE_ARGS:-}
    fi
    local log="$out/$label.up.log"
    # The workers price their steps against the profile: `bench serve` records, per rate, how
    # long their steps took against it, and `plan --measured` predicts at that speed too.
    "$ferry" up --model "${MODEL:-default}" --listen 127.0.0.1:0 --http 127.0.0.1:0 --threads 1 --pin --no-prefix-cache \
        --profile "$profile" "${emulate[@]}" "${pools[@]}" > "$log" 2>&1 &
    local up=$!
    local router=""
    for _ in $(seq 1 600); do
        router="$(grep -o 'ready router=[0-9.:]*' "$log" | cut -d= -f2 || true)"
        [ -n "$router" ] && break
        sleep 0.2
    done
    [ -n "$router" ] || { echo "$split: cluster did not start (see $log)" >&2; kill "$up"; exit 1; }
    echo "== $split ($label): bench serve against $router at $rates req/s" >&2
    "$ferry" bench serve --router "$router" "${load[@]}" --rates "$rates" --label "$split" --out "$out/$label.json"
    kill -TERM "$up"; wait "$up" || true
    measured+=("$split=$out/$label.json@$profile")
}

measured=()
for split in "${splits[@]}"; do
    case "$split" in
        *:*) pools=(--prefill "${split%%:*}" --decode "${split##*:}") ;;
        *c) pools=(--prefill 0 --decode 0 --colocated "${split%c}") ;;
        *) echo "bad split $split (P:D or Nc)" >&2; exit 1 ;;
    esac
    label="split-${split/:/p}"
    own="RATES_${split/:/p}"
    rates="${!own:-${RATES:-0.2,0.4,0.6}}"
    if [ "${PROFILE_EVERY:-split}" = rate ]; then
        IFS=, read -r -a cells_rates <<< "$rates"
        for rate in "${cells_rates[@]}"; do
            measure "$split" "$label-r$rate" "$rate"
        done
    else
        measure "$split" "$label" "$rates"
    fi
done

cells="$(IFS=,; echo "${measured[*]}")"
"$ferry" plan --measured "$cells" | tee "$out/validation.md"
"$ferry" plan --measured "$cells" --json > "$out/validation.json"
echo "results in $out" >&2
