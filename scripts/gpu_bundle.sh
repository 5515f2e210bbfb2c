#!/usr/bin/env bash
# Build and pack what one GPU session carries to the device machine (scripts/gpu_check.sh runs
# there), so the session spends its device minutes on the checks, not on the packing:
#
#   .gpu/bins.tgz   the `ferry` binary with the `cuda` feature and the three GPU test binaries
#                   (cuda_kernels, cuda_engine, smollm2), stripped (~17 MB packed)
#   .gpu-a/part.a   the SmolLM2 GGUF in pieces, as large as a call can carry next to the tree
#   .gpu-b/part.b   (64 MiB in all: the 98 MB model goes in two calls to the same warm machine
#                   while the tree is under ~17 MB; gpu_check.sh joins them and checks the SHA-256)
#
# The three folders are kept out of git (.git/info/exclude) and named in each call's `carry`.
# Then, on the device machine (each a `run` call; the first two only copy a piece):
#   A  carry .gpu-a: mkdir -p /tmp/ferry-model && cp .gpu-a/part.a /tmp/ferry-model/
#   B  carry .gpu-b: cp .gpu-b/part.b /tmp/ferry-model/   (and so on for .gpu-c, if made)
#   C  carry .gpu:   tar xzf .gpu/bins.tgz -C .gpu && OUT=$OUT/gc FERRY_BIN=.gpu/ferry \
#        TEST_BINS=".gpu/cuda_kernels .gpu/cuda_engine .gpu/smollm2" STEPS="1 2 3 4 5 6 7" \
#        bash scripts/gpu_check.sh; tar czf $OUT/gc.tgz -C $OUT gc
#   D  as C with STEPS="8 9 10 11 12" (the benchmarks), if the device time allows.
#
# Environment: FERRY_SMOLLM2_GGUF (default: the model `ferry` fetches, under ~/.cache/ferry).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODEL="${FERRY_SMOLLM2_GGUF:-$HOME/.cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

grep -qxF "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude

echo "== building ferry with the cuda feature" >&2
cargo build --release -p ferry --features cuda
echo "== building the GPU test binaries" >&2
tests_json=$(cargo test --release -p ferry-engine --features cuda --test cuda_kernels --test cuda_engine --test smollm2 --no-run --message-format=json)

rm -rf .gpu
mkdir -p .gpu/bin
strip -o .gpu/bin/ferry target/release/ferry
for t in cuda_kernels cuda_engine smollm2; do
    exe=$(printf '%s\n' "$tests_json" | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name and "test" in m["target"]["kind"]:
        print(m["executable"])
' "$t" | tail -1)
    [ -n "$exe" ] || { echo "error: no executable for the $t test" >&2; exit 1; }
    strip -o ".gpu/bin/$t" "$exe"
done
tar czf .gpu/bins.tgz -C .gpu/bin ferry cuda_kernels cuda_engine smollm2
rm -rf .gpu/bin

# Each call carries the tree (the files git tracks, and untracked ones it does not ignore) with
# one of these, 64 MiB in all: the model goes in as many pieces as that leaves room for (two while
# the tree is under ~17 MB), .gpu-a/part.a, .gpu-b/part.b, ... (gpu_check.sh joins part.* in order).
limit=$((64 << 20))
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s }')
awk -v s="$tree" 'BEGIN { printf "%-16s %6.1f MB\n", "(the tree)", s / 1e6 }'
rm -rf .gpu-?
if [ -f "$MODEL" ] && [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$SHA" ]; then
    piece=$((limit - tree - (256 << 10)))
    [ "$piece" -gt $((8 << 20)) ] || { echo "error: the tree ($tree bytes) leaves no room for a model piece in a call" >&2; exit 1; }
    tmp=$(mktemp -d)
    split -b "$piece" -a 1 "$MODEL" "$tmp/part."
    for f in "$tmp"/part.*; do
        d=".gpu-${f##*.}"
        mkdir -p "$d"
        mv "$f" "$d/"
        grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
    done
    rmdir "$tmp"
    [ "$(cat .gpu-?/part.? | sha256sum | cut -d' ' -f1)" = "$SHA" ] || { echo "error: the pieces do not join to the model" >&2; exit 1; }
else
    echo "warning: no SmolLM2 GGUF with the published checksum at $MODEL: no model pieces (run ferry once to fetch it)" >&2
fi
for f in .gpu/bins.tgz .gpu-?/part.?; do
    [ -f "$f" ] || continue
    size=$(stat -c %s "$f")
    awk -v f="$f" -v s="$size" 'BEGIN { printf "%-16s %6.1f MB\n", f, s / 1e6 }'
    [ $((size + tree)) -lt "$limit" ] || echo "warning: $f and the tree are over the 64 MiB one call carries" >&2
done
echo "ready: carry $(ls -d .gpu-? 2>/dev/null | tr '\n' ' ')then .gpu, one call each (see this script's header for the commands)"
