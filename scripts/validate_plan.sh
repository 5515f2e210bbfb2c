#!/usr/bin/env bash
# Issue #19's validation: predict with `ferry plan`, then measure with `ferry bench serve`, on this
# machine, for several splits at several rates, and print the predicted-vs-measured table.
#
# 1. `ferry profile` measures one worker's step costs, one thread pinned to a core as the workers
#    below run (`ferry up --threads 1 --pin`), twice: alone (for the splits of one worker), and
#    with a second profile running on core 1 at the same time (for the splits of two workers:
#    each worker then shares the memory bandwidth and caches with a busy neighbour, which a
#    profile measured alone does not see). Every profile walks its grid in several passes.
# 2. For each split, a `ferry up` cluster of it (prefix caches off: every rate replays the same
#    prompts, and the simulation has no cache) serves the same seeded `bench serve` workload at
#    each rate (results in OUT/<split>.json, each request recorded).
# 3. `ferry plan --measured` predicts every (split, rate) cell from the profile that matches the
#    split, with the workload, seed and SLOs recorded in those files, and prints the errors (and,
#    per request, the median of measured / predicted TTFT and TPOT).
#
# Usage: scripts/validate_plan.sh [OUT_DIR]   (build first: cargo build -p ferry)
# Knobs: FERRY (binary), SPLITS ("1:1 2c 1c"), RATES, REQUESTS, PROMPT_LEN, OUTPUT_LEN,
#        SLO_TTFT_MS, SLO_TPOT_MS, PROFILE_ARGS (extra `ferry profile` flags), PROFILE and
#        PROFILE_ALONE (reuse profiles instead of measuring them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-target/validate-plan}"
mkdir -p "$out"
ferry="${FERRY:-./target/debug/ferry}"
splits=(${SPLITS:-1:1 2c 1c})
load=(--requests "${REQUESTS:-20}" --prompt-len "${PROMPT_LEN:-32..512}" --output-len "${OUTPUT_LEN:-32..96}" --seed 7
      --rates "${RATES:-0.2,0.4,0.6}" --slo-ttft-ms "${SLO_TTFT_MS:-5000}" --slo-tpot-ms "${SLO_TPOT_MS:-45}")

profile="${PROFILE:-$out/profile.json}"
alone="${PROFILE_ALONE:-$out/profile-alone.json}"
if [ -z "${PROFILE:-}" ]; then
    # shellcheck disable=SC2086
    taskset -c 0 "$ferry" profile --model default --threads 1 --out "$profile" ${PROFILE_ARGS:-} &
    pair=$!
    # shellcheck disable=SC2086
    taskset -c 1 "$ferry" profile --model default --threads 1 --out "$out/profile-neighbour.json" ${PROFILE_ARGS:-} > /dev/null
    wait "$pair"
fi
if [ -z "${PROFILE_ALONE:-}" ]; then
    # shellcheck disable=SC2086
    taskset -c 0 "$ferry" profile --model default --threads 1 --out "$alone" ${PROFILE_ARGS:-}
fi

measured=()
measured_alone=()
for split in "${splits[@]}"; do
    case "$split" in
        *:*) pools=(--prefill "${split%%:*}" --decode "${split##*:}"); workers=$(( ${split%%:*} + ${split##*:} )) ;;
        *c) pools=(--prefill 0 --decode 0 --colocated "${split%c}"); workers=${split%c} ;;
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
    if [ "$workers" -gt 1 ]; then measured+=("$split=$out/$label.json"); else measured_alone+=("$split=$out/$label.json"); fi
done

: > "$out/validation.md"
for group in "$profile:${measured[*]}" "$alone:${measured_alone[*]}"; do
    prof="${group%%:*}" cells="${group#*:}"
    [ -n "$cells" ] || continue
    name="$(basename "$prof" .json)"
    echo "### predicted from $name" | tee -a "$out/validation.md"
    "$ferry" plan --profile "$prof" --measured "${cells// /,}" | tee -a "$out/validation.md"
    "$ferry" plan --profile "$prof" --measured "${cells// /,}" --json > "$out/validation-$name.json"
done
echo "results in $out" >&2
