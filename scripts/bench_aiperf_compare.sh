#!/usr/bin/env bash
# Issue 37 part 6: one configuration measured by `ferry bench serve` and by NVIDIA's aiperf
# (PyPI, pinned as tests/cluster.rs pins it) on the same `ferry up`, in turn (ferry, aiperf,
# ferry, aiperf, ...) so the machine's drift falls on both: SmolLM2-135M Q4_1, 1 prefill + 1
# decode worker (one compute thread each), a closed loop of CONCURRENCY requests in flight,
# REQUESTS requests per run, prompts of about ISL tokens, exactly OSL output tokens (bench serve
# ignores EOS; aiperf sends vLLM's min_tokens = OSL with max_completion_tokens = OSL). Each run
# its own seed, so no run is served from the prefix cache an earlier one filled. Then
# scripts/lib/aiperf_compare.py prints the side-by-side table.
# Usage: scripts/bench_aiperf_compare.sh [OUT_DIR]
#   (build first: cargo build --release -p ferry; AIPERF=path/to/aiperf, default target/py-aiperf,
#   made with: python3 -m venv target/py-aiperf && target/py-aiperf/bin/pip install aiperf==0.13.0)
set -euo pipefail
TIMEFORMAT='wall %R s, cpu %U s user + %S s sys'
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib/up.sh
out="${1:-target/aiperf-compare}"
mkdir -p "$out"
ferry="${FERRY:-./target/release/ferry}"
aiperf="${AIPERF:-target/py-aiperf/bin/aiperf}"
model="${FERRY_SMOLLM2_GGUF:-$HOME/.cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
requests="${REQUESTS:-24}" conc="${CONCURRENCY:-2}" isl="${ISL:-128}" osl="${OSL:-32}"
# aiperf makes its synthetic prompts with a local tokenizer (the llama fixture's: it has no
# network); the server counts them again with SmolLM2's, and wraps them in the chat template.
tokenizer="${TOKENIZER:-tests/fixtures/golden/llama-bf16}"

up_cluster "$ferry" "$out/up.log" --threads 1 --prefill 1 --decode 1 --model "$model"
http="$(grep -o 'http=[0-9.:]*' "$out/up.log" | head -1 | cut -d= -f2)"
trap down_cluster EXIT
for round in $(seq 1 "${ROUNDS:-2}"); do
    # A rate far past capacity: every request is due at once, and --max-concurrency keeps
    # CONCURRENCY in flight (the closed loop aiperf's --concurrency runs).
    # Each client's own CPU time (user + sys, its children included) goes to CLIENT.ROUND.cpu: on a
    # 2-core machine the client shares the cores with the workers it measures.
    { time "$ferry" bench serve --router "$ROUTER" --rates 1000 --max-concurrency "$conc" --requests "$requests" \
        --prompt-len "${FERRY_ISL:-$isl}" --output-len "$osl" --seed "$((100 + round))" --slo-ttft-ms 60000 --slo-tpot-ms 1000 \
        --label "ferry bench serve, round $round" --out "$out/ferry.$round.json" > "$out/ferry.$round.log" 2>&1; } 2> "$out/ferry.$round.cpu"
    rm -rf "$out/aiperf.$round"
    { time env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$aiperf" profile --model SmolLM2-135M-Instruct --url "http://$http" \
        --endpoint-type chat --streaming --tokenizer "$tokenizer" \
        --extra-inputs "min_tokens:$osl" --use-server-token-count \
        --request-count "$requests" --concurrency "$conc" --isl "$isl" --isl-stddev 0 --osl "$osl" \
        --random-seed "$((200 + round))" --ui none --artifact-dir "$out/aiperf.$round" --export-level raw > "$out/aiperf.$round.log" 2>&1; } 2> "$out/aiperf.$round.cpu"
done
python3 scripts/lib/aiperf_compare.py "$out"
