#!/usr/bin/env bash
# The CUDA backend on a real GPU, for a session that has one (nothing here runs without one).
# Prepared on a machine without a GPU: none of it has been run yet.
#
# Build here (x86_64, no CUDA toolkit needed), then carry the binaries to the GPU machine:
#   cargo build --release -p ferry --features cuda
#   cargo test --release -p ferry-engine --features cuda --test cuda_kernels --test cuda_engine --no-run
#   strip -o target/gpu/ferry target/release/ferry; cp <the two test binaries it printed> target/gpu/
# and on the GPU machine, from the repository root:
#   FERRY_BIN=target/gpu/ferry KERNEL_TESTS="target/gpu/cuda_kernels-* target/gpu/cuda_engine-*" \
#       OUT=$OUT bash scripts/gpu_check.sh
#
# Steps (each logged under $OUT; the script goes on after a failure and exits non-zero at the end):
# 1. every kernel against its CPU oracle, and the engine on cuda (the cuda_kernels and cuda_engine
#    test binaries, FERRY_REQUIRE_GPU=1, fixtures from FERRY_FIXTURES=tests/fixtures);
# 2. the golden fixtures through `ferry score --device cuda`: logits within 1e-3 of HF transformers
#    (weights uploaded as f32 with FERRY_CUDA_F32_WEIGHTS=1; the bf16 fixture is also scored with
#    bf16 GEMMs and its difference printed);
# 3. SmolLM2 greedy generation on cuda and on cpu (the texts are printed and compared);
# 4. a cluster on the one GPU: `ferry up --device cuda` with a prefill and a decode worker, one
#    streamed completion over HTTP;
# 5. the same with `--kv-transport nccl`: both workers on one GPU cannot form a NCCL pair (NCCL
#    refuses two ranks on one device), so this checks, with a real libnccl, that the rendezvous
#    fails fast without hanging or crashing and the KV falls back to TCP (the workers' metrics are
#    printed). A real NCCL transfer needs two GPUs.
# Needs: python3 with numpy and safetensors (for step 2); libcuda, libnvrtc and libcublas loadable
# (NVRTC/cuBLAS from the CUDA toolkit or the nvidia-*-cu12 wheels on LD_LIBRARY_PATH).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

FERRY_BIN="${FERRY_BIN:-target/release/ferry}"
KERNEL_TESTS="${KERNEL_TESTS:-}"
OUT="${OUT:-target/gpu-check}"
MODEL="${FERRY_SMOLLM2_GGUF:-default}"
mkdir -p "$OUT"
failed=0
step() { echo; echo "== $*"; }
fail() { echo "FAIL: $*" >&2; failed=1; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt" || true

step "1. kernels vs CPU oracles"
if [ -n "$KERNEL_TESTS" ]; then
    for t in $KERNEL_TESTS; do
        FERRY_REQUIRE_GPU=1 FERRY_FIXTURES="$PWD/tests/fixtures" "$t" --nocapture --test-threads=1 2>&1 | tee -a "$OUT/kernels.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || fail "$t"
    done
else
    echo "skipped: KERNEL_TESTS (the cuda_kernels test binary) not given"
fi

step "2. golden fixtures on cuda"
for dir in tests/fixtures/golden/*/; do
    name="$(basename "$dir")"
    for mode in f32 native; do
        env_f32=0
        [ "$mode" = f32 ] && env_f32=1
        FERRY_CUDA_F32_WEIGHTS=$env_f32 "$FERRY_BIN" score --device cuda --model "$dir" --tokens "$dir/golden.safetensors" --out "$OUT/$name-$mode.safetensors" >"$OUT/$name-$mode.log" 2>&1 \
            || { fail "$name ($mode weights): ferry score"; cat "$OUT/$name-$mode.log" >&2; continue; }
        python3 - "$dir/golden.safetensors" "$OUT/$name-$mode.safetensors" "$name" "$mode" <<'PY' || fail "$name ($mode weights): logits differ"
import sys
import numpy as np
from safetensors.numpy import load_file
want, got, name, mode = load_file(sys.argv[1])["logits"], load_file(sys.argv[2])["logits"], sys.argv[3], sys.argv[4]
d = float(np.abs(want.reshape(got.shape) - got).max())
print(f"{name} ({mode} weights): max |dlogit| = {d:.2e}")
# f32 weights: the reference's precision. Native half-precision GEMMs: reported, loosely bounded.
sys.exit(0 if d <= (1e-3 if mode == "f32" else 0.25) else 1)
PY
    done
done

step "3. SmolLM2 greedy generation, cuda vs cpu"
prompt="Write one sentence about ferries."
for dev in cuda cpu; do
    "$FERRY_BIN" generate --device "$dev" -m "$MODEL" --max-tokens 48 --temperature 0 "$prompt" >"$OUT/smollm2-$dev.txt" 2>"$OUT/smollm2-$dev.log" \
        || { fail "generate on $dev"; cat "$OUT/smollm2-$dev.log" >&2; }
    echo "--- $dev:"; cat "$OUT/smollm2-$dev.txt"; tail -3 "$OUT/smollm2-$dev.log"
done
if cmp -s "$OUT/smollm2-cuda.txt" "$OUT/smollm2-cpu.txt"; then echo "same text on cuda and cpu"; else echo "note: the texts differ (bf16 GEMMs on cuda)"; fi

# `ferry up` on the GPU with one prefill and one decode worker, logging to $OUT/up-NAME.log; sets
# up_pid and http. Fails (and returns 1) if the cluster does not come up.
cluster_up() {
    local name="$1"; shift
    "$FERRY_BIN" up --device cuda --prefill 1 --decode 1 -m "$MODEL" --listen 127.0.0.1:0 --http 127.0.0.1:0 "$@" >"$OUT/up-$name.log" 2>&1 &
    up_pid=$!
    http=""
    for _ in $(seq 1 120); do
        http="$(grep -o 'http=[0-9.:]*' "$OUT/up-$name.log" | head -1 | cut -d= -f2)"
        if [ -n "$http" ] && grep -q '^decode' "$OUT/up-$name.log"; then return 0; fi
        kill -0 "$up_pid" 2>/dev/null || break
        sleep 1
    done
    fail "$name did not come up"; cat "$OUT/up-$name.log" >&2
    return 1
}

# One greedy completion through the cluster's HTTP API, into $OUT/NAME.json.
completion() {
    local name="$1"
    curl -sS --max-time 120 "http://$http/v1/completions" -H 'content-type: application/json' \
        -d '{"model":"default","prompt":"The capital of France is","max_tokens":16,"temperature":0}' | tee "$OUT/$name.json" \
        || fail "$name completion"
    echo
    grep -q '"text"' "$OUT/$name.json" 2>/dev/null || fail "$name: no completion text"
}

cluster_down() {
    kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null
}

step "4. cluster on the GPU: ferry up --device cuda (1 prefill + 1 decode)"
if cluster_up cluster; then
    completion cluster
fi
cluster_down

step "5. --kv-transport nccl on one GPU: the fallback with a real libnccl"
# cudarc loads `libnccl.so`; the nvidia-nccl-cu12 wheel (torch's) ships only libnccl.so.2.
nccl_dir="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ]; then
    mkdir -p "$OUT/nccl-lib" && ln -sf "$nccl_dir/libnccl.so.2" "$OUT/nccl-lib/libnccl.so"
    export LD_LIBRARY_PATH="$PWD/$OUT/nccl-lib:$nccl_dir:${LD_LIBRARY_PATH:-}"
fi
if cluster_up cluster-nccl --kv-transport nccl; then
    completion cluster-nccl
    for m in $(grep -o 'metrics=[0-9.:]*' "$OUT/up-cluster-nccl.log" | cut -d= -f2); do
        curl -sS --max-time 5 "http://$m/metrics" | grep -E '^ferry_(kv_transport_fallbacks|kv_transfers|kv_nccl)' | sed "s|^|$m |"
    done | tee "$OUT/nccl-metrics.txt"
    grep -iE 'nccl' "$OUT/up-cluster-nccl.log" | head -20
fi
cluster_down

echo
[ "$failed" -eq 0 ] && echo "gpu check passed" || echo "gpu check FAILED (logs in $OUT)"
exit "$failed"
