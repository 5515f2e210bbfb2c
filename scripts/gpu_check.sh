#!/usr/bin/env bash
# The CUDA backend on a real GPU, for a session that has one (nothing here runs without one).
# Prepared on a machine without a GPU: none of it has been run yet.
#
# Build here (x86_64, no CUDA toolkit needed), then carry the binaries to the GPU machine:
#   cargo build --release -p ferry --features cuda
#   cargo test --release -p ferry-engine --features cuda --test cuda_kernels --test cuda_engine --test smollm2 --no-run
#   mkdir -p .gpu && strip -o .gpu/ferry target/release/ferry; strip the three test binaries it printed into .gpu/
#   (.gpu/ ignored through .git/info/exclude, named in `carry`)
# and on the GPU machine, from the repository root:
#   FERRY_BIN=.gpu/ferry TEST_BINS=".gpu/cuda_kernels-* .gpu/cuda_engine-* .gpu/smollm2-*" OUT=$OUT bash scripts/gpu_check.sh
# STEPS="1 6" runs only those steps.
#
# Sizes (measured here on 2026-11-30): the tracked tree is 11.6 MB; the four stripped binaries
# 37.6 MB (ferry 20.5, smollm2 7.7, cuda_engine 7.3, cuda_kernels 2.1), 16.4 MB as a gzipped tar.
# The device machine takes at most 64 MiB of tree and carried files per call, and the SmolLM2
# GGUF alone is 98 MB: steps 1 (smollm2) and 3 need it at $FERRY_SMOLLM2_GGUF (default
# /tmp/ferry-model/SmolLM2-135M-Instruct.Q4_1.gguf). Bring it in pieces over calls to one warm
# machine (it stays warm 30 s after a call): `split -n 3` the GGUF into .gpu-model/ here; calls 1
# and 2 each carry one piece and append it to the file under /tmp/ferry-model/ there; call 3
# carries the last piece and the gzipped binaries (11.6 + 33 + 16.4 MB) and runs this script.
# Without the model those steps say they are skipped and the clusters of steps 4-5 serve the
# golden llama-gqa model.
#
# Steps (each logged under $OUT; the script goes on after a failure and exits non-zero at the end):
# 0. make the CUDA libraries loadable under the names cudarc asks for (libnvrtc.so, libcublas.so,
#    libcublasLt.so, libnccl.so: the CUDA 13 wheels ship only versioned names);
# 1. every kernel against its CPU oracle (cuda_kernels, FERRY_REQUIRE_GPU=1), the engine on cuda
#    (cuda_engine), and SmolLM2 on cuda against HF transformers (the smollm2 test with
#    FERRY_TEST_DEVICE=cuda and f32 weights: logits within 1e-3, the reference greedy text of
#    `capital` and `story`), fixtures from FERRY_FIXTURES=tests/fixtures;
# 2. the golden fixtures through `ferry score --device cuda`: logits within 1e-3 of HF transformers
#    (weights uploaded as f32 with FERRY_CUDA_F32_WEIGHTS=1; the bf16 fixture is also scored with
#    bf16 GEMMs and its difference printed);
# 3. SmolLM2 greedy generation on cuda and on cpu (the texts are printed and compared);
# 4. a cluster on the one GPU: `ferry up --device cuda` with a prefill and a decode worker, one
#    completion over HTTP;
# 5. the same with `--kv-transport nccl`: both workers on one GPU cannot form a NCCL pair (NCCL
#    refuses two ranks on one device), so this checks, with a real libnccl, that the rendezvous
#    fails fast without hanging or crashing and the KV falls back to TCP (the workers' metrics are
#    printed). A real NCCL transfer needs two GPUs;
# 6. the benchmark of issue 5: a Llama-3-8B-shaped model with random bf16 weights made on the
#    device (`--model synthetic:llama3-8b`), prefill of 2,048 tokens, decode at batch 1 and 32,
#    with the device's copy bandwidth and bf16 GEMM peak measured in the same run
#    ($OUT/bench-ferry.json), then HF transformers eager on the same shapes
#    (scripts/bench_hf_gpu.py, $OUT/bench-hf.json).
# Needs: python3 with numpy and safetensors (step 2), torch and transformers (step 6); libcuda.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

FERRY_BIN="${FERRY_BIN:-target/release/ferry}"
TEST_BINS="${TEST_BINS:-${KERNEL_TESTS:-}}"
OUT="${OUT:-target/gpu-check}"
MODEL="${FERRY_SMOLLM2_GGUF:-/tmp/ferry-model/SmolLM2-135M-Instruct.Q4_1.gguf}"
# The GGUF brought in pieces by earlier calls to the same warm machine (part.a, part.b, ...).
if [ ! -f "$MODEL" ] && ls "$(dirname "$MODEL")"/part.* >/dev/null 2>&1; then
    cat "$(dirname "$MODEL")"/part.* >"$MODEL.tmp" && mv "$MODEL.tmp" "$MODEL"
fi
# The wheel's published file (../shared/fixtures/README.md); a partial or corrupt copy is not used.
if [ -f "$MODEL" ] && [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ]; then
    echo "SmolLM2 GGUF at $MODEL has the wrong checksum: not used"; rm -f "$MODEL"
fi
CLUSTER_MODEL="$MODEL"
[ -f "$MODEL" ] || CLUSTER_MODEL=tests/fixtures/golden/llama-gqa
mkdir -p "$OUT"
STEPS="${STEPS:-1 2 3 4 5 6}"
failed=0
T0=$SECONDS
step() { echo; echo "== [$((SECONDS - T0)) s] $*"; }
fail() { echo "FAIL: $*" >&2; failed=1; }
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step "0. CUDA libraries under the names cudarc loads"
libdir=/tmp/ferry-cuda-lib
mkdir -p "$libdir"
search="$(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p)))' 2>/dev/null) /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu"
for lib in nvrtc cublas cublasLt nccl; do
    found=""
    for d in $search; do
        f="$(ls "$d"/lib$lib.so* 2>/dev/null | sort -V | tail -1)"
        [ -n "$f" ] && { found="$f"; break; }
    done
    if [ -n "$found" ]; then
        ln -sf "$found" "$libdir/lib$lib.so"
        export LD_LIBRARY_PATH="$libdir:$(dirname "$found"):${LD_LIBRARY_PATH:-}"
        echo "lib$lib.so -> $found"
    else
        echo "lib$lib.so: not found (searched $search)"
    fi
done

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt" || true

if want 1; then
step "1. kernels vs CPU oracles, the engine and SmolLM2 on cuda"
if [ -n "$TEST_BINS" ]; then
    for t in $TEST_BINS; do
        case "$t" in
            *smollm2*)
                [ -f "$MODEL" ] || { echo "skipped $t: no SmolLM2 GGUF at $MODEL"; continue; }
                FERRY_TEST_DEVICE=cuda FERRY_CUDA_F32_WEIGHTS=1 FERRY_SMOLLM2_GGUF="$MODEL" FERRY_FIXTURES="$PWD/tests/fixtures" timeout 120 "$t" --nocapture --test-threads=1 2>&1 | tee -a "$OUT/kernels.log"; rc=${PIPESTATUS[0]} ;;
            *)
                FERRY_REQUIRE_GPU=1 FERRY_FIXTURES="$PWD/tests/fixtures" timeout 120 "$t" --nocapture --test-threads=1 2>&1 | tee -a "$OUT/kernels.log"; rc=${PIPESTATUS[0]} ;;
        esac
        [ "$rc" -eq 0 ] || fail "$t"
    done
else
    echo "skipped: TEST_BINS (the cuda_kernels, cuda_engine and smollm2 test binaries) not given"
fi
fi

if want 2; then
step "2. golden fixtures on cuda"
for dir in tests/fixtures/golden/*/; do
    name="$(basename "$dir")"
    for mode in f32 native; do
        env_f32=0
        [ "$mode" = f32 ] && env_f32=1
        FERRY_CUDA_F32_WEIGHTS=$env_f32 timeout 60 "$FERRY_BIN" score --device cuda --model "$dir" --tokens "$dir/golden.safetensors" --out "$OUT/$name-$mode.safetensors" >"$OUT/$name-$mode.log" 2>&1 \
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
fi

if want 3; then
step "3. SmolLM2 greedy generation, cuda vs cpu"
if [ -f "$MODEL" ]; then
    prompt="Write one sentence about ferries."
    for dev in cuda cpu; do
        timeout 90 "$FERRY_BIN" generate --device "$dev" -m "$MODEL" --max-tokens 48 --temperature 0 "$prompt" >"$OUT/smollm2-$dev.txt" 2>"$OUT/smollm2-$dev.log" \
            || { fail "generate on $dev"; cat "$OUT/smollm2-$dev.log" >&2; }
        echo "--- $dev:"; cat "$OUT/smollm2-$dev.txt"; tail -3 "$OUT/smollm2-$dev.log"
    done
    if cmp -s "$OUT/smollm2-cuda.txt" "$OUT/smollm2-cpu.txt"; then echo "same text on cuda and cpu"; else echo "note: the texts differ (bf16 GEMMs on cuda)"; fi
else
    echo "skipped: no SmolLM2 GGUF at $MODEL (see the header)"
fi
fi

# `ferry up` on the GPU with one prefill and one decode worker, logging to $OUT/up-NAME.log; sets
# up_pid and http. Fails (and returns 1) if the cluster does not come up.
cluster_up() {
    local name="$1"; shift
    timeout 150 "$FERRY_BIN" up --device cuda --prefill 1 --decode 1 -m "$CLUSTER_MODEL" --listen 127.0.0.1:0 --http 127.0.0.1:0 "$@" >"$OUT/up-$name.log" 2>&1 &
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

if want 4; then
step "4. cluster on the GPU: ferry up --device cuda (1 prefill + 1 decode), model $CLUSTER_MODEL"
if cluster_up cluster; then
    completion cluster
fi
cluster_down
fi

if want 5; then
step "5. --kv-transport nccl on one GPU: the fallback with a real libnccl"
# (libnccl.so was linked in step 0.)
if cluster_up cluster-nccl --kv-transport nccl; then
    completion cluster-nccl
    for m in $(grep -o 'metrics=[0-9.:]*' "$OUT/up-cluster-nccl.log" | cut -d= -f2); do
        curl -sS --max-time 5 "http://$m/metrics" | grep -E '^ferry_(kv_transport_fallbacks|kv_transfers|kv_nccl)' | sed "s|^|$m |"
    done | tee "$OUT/nccl-metrics.txt"
    grep -iE 'nccl' "$OUT/up-cluster-nccl.log" | head -20
fi
cluster_down

fi

if want 6; then
step "6. benchmark: Llama-3-8B shapes, random bf16 weights on the device; Ferry, then HF transformers"
timeout 180 "$FERRY_BIN" bench engine --device cuda --model synthetic:llama3-8b --prompt-len 2048 --gen 64 --repeats 3 --batch 32 \
    >"$OUT/bench-ferry.json" 2>"$OUT/bench-ferry.log" || { fail "ferry bench engine"; tail -20 "$OUT/bench-ferry.log" >&2; }
cat "$OUT/bench-ferry.json"
PYTHONUNBUFFERED=1 timeout 180 python3 scripts/bench_hf_gpu.py --model llama3-8b --prompt-len 2048 --gen 64 --repeats 3 --batch 32 \
    >"$OUT/bench-hf.json" 2>"$OUT/bench-hf.log" || { fail "HF transformers benchmark"; tail -20 "$OUT/bench-hf.log" >&2; }
cat "$OUT/bench-hf.json"
fi

echo
echo "[$((SECONDS - T0)) s in all]"
[ "$failed" -eq 0 ] && echo "gpu check passed" || echo "gpu check FAILED (logs in $OUT)"
exit "$failed"
