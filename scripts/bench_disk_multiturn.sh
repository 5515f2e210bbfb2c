#!/usr/bin/env bash
# Issue 38: multi-turn conversations past the KV pool, the pool alone against the pool plus the
# disk tier, in turn for each seed (one prefill and one decode worker of 1,024 KV tokens each,
# exact activations so that answers can be compared; a fresh tier directory per seed).
# Usage: scripts/bench_disk_multiturn.sh [OUT_DIR]
#   (FERRY: the binary [target/release/ferry]; SEEDS ["386 387"]; RATE conversations/s [1];
#   UP_FLAGS: more `ferry up` flags for both arms, e.g. "--local-prefill-max 0"; KV_TOKENS: each
#   worker's pool [1024]: the conversations' history at the last turn is ~7,300 tokens, 7x that;
#   the workload's shape: USERS [16], TURNS [4], SYSTEM_TOKENS [32], USER_TOKENS [64..128],
#   OUTPUT_LEN [16], THINK_MS [15000])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/disk-multiturn}"
mkdir -p "$out"
ferry="${FERRY:-./target/release/ferry}"
read -r -a extra <<< "${UP_FLAGS:-}"
for seed in ${SEEDS:-386 387}; do
    work=(--workload multiturn --rates "${RATE:-1}" --users "${USERS:-16}" --turns "${TURNS:-4}"
          --system-tokens "${SYSTEM_TOKENS:-32}" --user-tokens "${USER_TOKENS:-64..128}"
          --output-len "${OUTPUT_LEN:-16}" --think-ms "${THINK_MS:-15000}" --seed "$seed")
    rm -rf "$out/kv-disk"
    for arm in off disk; do
        flags=(--prefill 1 --decode 1 --kv-tokens "${KV_TOKENS:-1024}" --activations exact "${extra[@]}")
        [ "$arm" = disk ] && flags+=(--kv-disk "$out/kv-disk")
        up_cluster "$ferry" "$out/up-$arm-$seed.log" "${flags[@]}"
        "$ferry" bench serve --router "$ROUTER" "${work[@]}" --label "$arm-$seed" --out "$out/$arm-$seed.json" | tee "$out/$arm-$seed.log"
        down_cluster
    done
done
