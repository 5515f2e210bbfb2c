#!/usr/bin/env bash
# The CUDA backend on a real GPU, for a session that has one (nothing here runs without one).
# First run on an H200: 2026-12-04 (docs/benchmarks.md, "On a GPU").
#
# Build here (x86_64, no CUDA toolkit needed) with scripts/gpu_bundle.sh, which builds the cuda
# binaries, strips and packs them into .gpu/bins.tgz and cuts the model into pieces (its header
# has the calls to make); on the GPU machine, from the repository root:
#   tar xzf .gpu/bins.tgz -C .gpu
#   OUT=/tmp/gc FERRY_BIN=.gpu/ferry TEST_BINS=".gpu/cuda_kernels .gpu/cuda_engine .gpu/smollm2" bash scripts/gpu_check.sh
#   tar czf $OUT/gc.tgz -C /tmp gc      (only 8 files come back from a run: pack the logs)
# STEPS="1 6" runs only those steps.
#
# The SmolLM2 GGUF (98 MB) does not fit in one call with the tree and the binaries: the earlier
# calls to the same warm machine copy gpu_bundle.sh's pieces to /tmp/ferry-model/part.a, part.b,
# ...; this script joins them and checks the SHA-256. Without it, steps 1 (smollm2) and 3 say
# they are skipped and the clusters serve the golden llama-gqa model.
#
# Steps (each logged under $OUT; the script goes on after a failure and exits non-zero at the end):
# 0. the CUDA libraries under the names cudarc loads (libnvrtc.so, libcublas.so, libcublasLt.so,
#    libnccl.so: the CUDA 13 wheels ship only versioned names);
# 1. every kernel against its CPU oracle (cuda_kernels, FERRY_REQUIRE_GPU=1), the engine on cuda
#    (cuda_engine), SmolLM2 on cuda against HF transformers (smollm2 with f32 weights);
# 2. the golden fixtures through `ferry score --device cuda`: f32 weights within 1e-3 of HF; the
#    bf16 checkpoint with bf16 GEMMs within the fixture's bf16 bound;
# 3. SmolLM2 greedy text on cuda (f32 weights) equal to the CPU engine's; bf16 weights reported;
# 4. clusters on the GPU (f32 weights): 1 prefill + 1 decode over TCP and over CUDA IPC, and one
#    colocated worker: text equal to the CPU engine's, TTFT of each under the same light load;
#    then disaggregated over CUDA IPC and colocated again with f16 KV (serving's default), TTFT;
# 5. --kv-transport nccl on one GPU: NCCL cannot pair two ranks on one device, so the rendezvous
#    must fail fast and the KV fall back to TCP;
# 6. `ferry bench kv --device cuda`: the CUDA IPC pipe against the device's own copy of the same
#    bytes and against TCP from device memory, then once more with FERRY_KV_PIPE_TIMING=1 (each
#    side's time per phase of a transfer: descriptors, copies, checksums, confirmations);
# 7. `ferry profile --device cuda` of Llama-3-8B shapes (for `ferry plan`);
# 8. Llama-3-8B shapes with random bf16 weights made on the device: Ferry's prefill and decode
#    against the measured HBM and GEMM limits, and cuBLAS on the prefill's own matmul shapes
#    with f32 and bf16 outputs (`prefill_matmuls`); then again with FERRY_CUDA_GEMV=off (cuBLAS
#    for the decode matmuls), then HF transformers (sdpa) on the same shapes;
# 9. speculation's ceiling on the GPU (issue 36): `ferry bench spec-rows` on Llama-3-8B shapes at
#    batch 1, 8 and 32, 512 tokens of context: what a step of r rows per sequence costs against
#    one row, so `r * t1 / tr` is the most output tok/s any proposer can give at that batch;
# 10. the KV dtypes on the GPU (issue 35): `ferry bench kv-decode` on Llama-3-1B shapes with f32,
#    f16, bf16 and int8 caches, batch 8, at 1,024 and 4,096 tokens (one engine per type: the 1B
#    shapes keep four of them within an H100's memory).
# 11. decode attention split over the SMs (flash-decoding) or not: `ferry bench kv-decode` on
#    Llama-3-8B shapes, f16 cache, batch 1 and 8, at 2,048 and 8,000 tokens, with
#    FERRY_CUDA_ATTENTION_SPLIT=off and =auto alternated twice (one process per run).
# 12. where a step's GPU time goes (FERRY_CUDA_PROFILE=1: timing events around each operation,
#    reported per kind of step on stderr): `ferry bench engine` on Llama-3-8B shapes (prefill of
#    2,048 tokens, decode at batch 1 and 32), and `ferry bench kv-decode` at batch 1 and 8,000
#    tokens of context with the split on and off.
# Needs: python3 with numpy and safetensors (step 2), torch and transformers (step 8); libcuda.
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
STEPS="${STEPS:-1 2 3 4 5 6 7 8 9 10 11 12}"
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
                FERRY_REQUIRE_GPU=1 FERRY_FIXTURES="$PWD/tests/fixtures" timeout 120 "$t" --include-ignored --nocapture --test-threads=1 2>&1 | tee -a "$OUT/kernels.log"; rc=${PIPESTATUS[0]} ;;
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
ref, got, name, mode = load_file(sys.argv[1]), load_file(sys.argv[2])["logits"], sys.argv[3], sys.argv[4]
want = ref["logits"].reshape(got.shape)
d = float(np.abs(want - got).max())
print(f"{name} ({mode} weights): max |dlogit| vs HF f32 math = {d:.2e}")
if mode == "f32" or "logits_bf16_compute" not in ref:
    # f32 weights (or an f32 checkpoint either way): the reference's precision.
    sys.exit(0 if d <= 1e-3 else 1)
# A bf16 checkpoint with bf16 GEMMs: the fixture's stated bound against HF's bf16 math
# (../shared/fixtures/README.md): mean |d| <= 0.05 and top-1 agreement on >= 90% of positions.
b = ref["logits_bf16_compute"].reshape(got.shape)
mean, top1 = float(np.abs(b - got).mean()), float((b.argmax(-1) == got.argmax(-1)).mean())
print(f"{name} ({mode} weights) vs HF bf16 math: mean |dlogit| = {mean:.4f} (bound 0.05), top-1 agreement {top1:.1%} (bound 90%)")
sys.exit(0 if mean <= 0.05 and top1 >= 0.9 else 1)
PY
    done
done
fi

if want 3; then
step "3. SmolLM2 greedy generation: cuda (f32 weights) must equal cpu; cuda with bf16 weights reported"
if [ -f "$MODEL" ]; then
    prompt="Write one sentence about ferries."
    for run in cpu:0 cuda:1 cuda:0; do
        dev=${run%:*}; f32=${run#*:}; name="$dev$([ "$f32" = 1 ] && echo -f32)"
        FERRY_CUDA_F32_WEIGHTS=$f32 timeout 90 "$FERRY_BIN" generate --device "$dev" --activations exact -m "$MODEL" --max-tokens 48 --temperature 0 "$prompt" >"$OUT/smollm2-$name.txt" 2>"$OUT/smollm2-$name.log" \
            || { fail "generate on $name"; cat "$OUT/smollm2-$name.log" >&2; }
        echo "--- $name:"; cat "$OUT/smollm2-$name.txt"; tail -1 "$OUT/smollm2-$name.log"
    done
    if cmp -s "$OUT/smollm2-cuda-f32.txt" "$OUT/smollm2-cpu.txt"; then echo "same text on cuda (f32 weights) and cpu"; else fail "SmolLM2 greedy text on cuda (f32 weights) differs from cpu"; fi
    cmp -s "$OUT/smollm2-cuda.txt" "$OUT/smollm2-cpu.txt" && echo "bf16 weights: same text too" || echo "bf16 weights: the text differs from cpu (bf16-rounded Q4_1 weights)"
else
    echo "skipped: no SmolLM2 GGUF at $MODEL (see the header)"
fi
fi

# `ferry up` on the GPU, logging to $OUT/up-NAME.log; sets up_pid, http and router. Fails (and
# returns 1) if the cluster does not come up. The workers inherit FERRY_CUDA_F32_WEIGHTS.
cluster_up() {
    local name="$1"; shift
    timeout 240 "$FERRY_BIN" up --device cuda --activations exact -m "$CLUSTER_MODEL" --listen 127.0.0.1:0 --http 127.0.0.1:0 "$@" >"$OUT/up-$name.log" 2>&1 &
    up_pid=$!
    http=""; router=""
    for _ in $(seq 1 600); do
        if grep -q '^ready ' "$OUT/up-$name.log"; then
            http="$(grep -o '^ready .*' "$OUT/up-$name.log" | grep -o 'http=[0-9.:]*' | head -1 | cut -d= -f2)"
            router="$(grep -o '^ready router=[0-9.:]*' "$OUT/up-$name.log" | head -1 | cut -d= -f2)"
            return 0
        fi
        kill -0 "$up_pid" 2>/dev/null || break
        sleep 0.2
    done
    fail "$name did not come up"; tail -20 "$OUT/up-$name.log" >&2
    return 1
}

cluster_down() {
    kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null
}

# The workers' KV transfer counters (which transport each transfer used, bytes, seconds).
kv_metrics() {
    for m in $(grep -o 'metrics=[0-9.:]*' "$OUT/up-$1.log" | cut -d= -f2); do
        curl -sS --max-time 5 "http://$m/metrics" | grep -E '^ferry_worker_(kv_transport_fallbacks|kv_transfers|kv_transfer_bytes|kv_transfer_seconds_(sum|count)|kv_buffer_bytes|kv_nccl)' | sed "s|^|$m |"
    done | tee "$OUT/$1-metrics.txt"
}

# The same greedy generation through the cluster as on the CPU engine (f32 weights on the GPU;
# exact activations on the CPU, whose default for `generate` is q8).
same_as_cpu() {
    local name="$1" prompt="Write one sentence about ferries."
    timeout 60 "$FERRY_BIN" generate --router "$router" --max-tokens 48 --temperature 0 "$prompt" >"$OUT/$name.txt" 2>"$OUT/$name.err" || fail "$name: generate through the cluster"
    timeout 90 "$FERRY_BIN" generate --device cpu --activations exact -m "$CLUSTER_MODEL" --max-tokens 48 --temperature 0 "$prompt" >"$OUT/$name-cpu.txt" 2>/dev/null
    echo "--- $name:"; cat "$OUT/$name.txt"
    if cmp -s "$OUT/$name.txt" "$OUT/$name-cpu.txt"; then echo "$name: same text as the CPU engine"; else fail "$name: the text differs from the CPU engine's"; cat "$OUT/$name-cpu.txt"; fi
}

# TTFT under a light load (16 requests of 1024-token prompts at 2/s, 16 tokens out, one seed:
# the same prompts for every configuration, all distinct, so no prefix cache hits).
ttft() {
    timeout 60 "$FERRY_BIN" bench serve --router "$router" --rates 2 --requests 16 --prompt-len 1024 --output-len 16 --seed 7 --label "$1" --out "$OUT/ttft-$1.json" >"$OUT/ttft-$1.log" 2>&1 || fail "$1: bench serve"
    grep -iE 'ttft' "$OUT/ttft-$1.log" | head -3
}

if want 4; then
step "4. clusters on the GPU (f32 weights): 1 prefill + 1 decode over tcp, then over cuda-ipc, then one colocated worker; output vs the CPU engine, TTFT"
export FERRY_CUDA_F32_WEIGHTS=1
for cfg in "disagg-tcp:--prefill 1 --decode 1 --kv-transport tcp" "disagg-ipc:--prefill 1 --decode 1 --kv-transport cuda-ipc" "colocated:--prefill 0 --decode 0 --colocated 1"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    # Over CUDA IPC, each side prints where each transfer's time went (FERRY_KV_PIPE_TIMING).
    if [ "$name" = disagg-ipc ]; then export FERRY_KV_PIPE_TIMING=1; else unset FERRY_KV_PIPE_TIMING; fi
    # shellcheck disable=SC2086
    if cluster_up "$name" $flags; then
        same_as_cpu "$name"
        ttft "$name"
        kv_metrics "$name"
        [ "$name" = disagg-ipc ] && { grep -q 'transport="cuda-ipc"' "$OUT/$name-metrics.txt" && echo "KV went over cuda-ipc" || fail "disagg-ipc: no transfer used cuda-ipc"; grep -iE 'ipc|pipe' "$OUT/up-$name.log" | grep -v 'FERRY_KV_PIPE_TIMING\|^  ' | head -5; }
        if [ "$name" = disagg-ipc ]; then
            for side in sender receiver; do
                echo "the last transfer's phases, $side side:"
                awk -v t="kv pipe $side" 'index($0, t) == 1 { buf = $0 "\n"; on = 1; next } on && /^  / { buf = buf $0 "\n"; next } { on = 0 } END { printf "%s", buf }' "$OUT/up-$name.log"
            done
        fi
    fi
    cluster_down
done
unset FERRY_KV_PIPE_TIMING
# The same TTFT comparison with the KV stored as serving stores it by default (f16: half the bytes
# to ship); the text is not compared (the CPU check above is the f32 one).
for cfg in "disagg-ipc-f16:--prefill 1 --decode 1 --kv-transport cuda-ipc --kv-dtype f16" "colocated-f16:--prefill 0 --decode 0 --colocated 1 --kv-dtype f16"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    # shellcheck disable=SC2086
    if cluster_up "$name" $flags; then
        ttft "$name"
        kv_metrics "$name" >/dev/null
    fi
    cluster_down
done
unset FERRY_CUDA_F32_WEIGHTS
fi

if want 5; then
step "5. --kv-transport nccl on one GPU: the fallback with a real libnccl"
if cluster_up cluster-nccl --prefill 1 --decode 1 --kv-transport nccl; then
    timeout 60 "$FERRY_BIN" generate --router "$router" --max-tokens 16 --temperature 0 "The capital of France is" || fail "nccl cluster: generate"
    kv_metrics cluster-nccl
    grep -iE 'nccl' "$OUT/up-cluster-nccl.log" | head -10
fi
cluster_down
fi

if want 6; then
step "6. KV transfer: CUDA IPC vs the device's own copy vs TCP, Llama-3-8B KV shapes (2048 tokens, 32 layers, 8 KV heads of 128, f32)"
timeout 120 "$FERRY_BIN" bench kv --device cuda --tokens 2048 --layers 32 --kv-heads 8 --head-dim 128 --repeats 5 >"$OUT/bench-kv.json" 2>"$OUT/bench-kv.log" || { fail "ferry bench kv"; tail -20 "$OUT/bench-kv.log" >&2; }
cat "$OUT/bench-kv.json"
timeout 60 "$FERRY_BIN" bench kv --device cuda --tokens 1024 --repeats 5 >"$OUT/bench-kv-smollm2.json" 2>>"$OUT/bench-kv.log" || fail "ferry bench kv (SmolLM2 shapes)"
cat "$OUT/bench-kv-smollm2.json"
# Where a CUDA IPC transfer's time goes, each side's phases per transfer (one repeat).
FERRY_KV_PIPE_TIMING=1 timeout 60 "$FERRY_BIN" bench kv --device cuda --tokens 2048 --layers 32 --kv-heads 8 --head-dim 128 --repeats 1 \
    >"$OUT/bench-kv-phases.json" 2>"$OUT/bench-kv-phases.log" || fail "ferry bench kv (phases)"
tail -40 "$OUT/bench-kv-phases.log"
fi

if want 7; then
step "7. profile of Llama-3-8B shapes on the GPU (for ferry plan)"
timeout 150 "$FERRY_BIN" profile --device cuda --model synthetic:llama3-8b --kv-tokens 90000 --max-batch-tokens 8192 --prompt-lens 256,1024,2048 --prompts 1,2,4 \
    --batches 1,4,16,32 --contexts 512,2048 --steps 8 --passes 2 --out "$OUT/profile-h200-llama3-8b.json" >"$OUT/profile.log" 2>&1 || { fail "ferry profile"; tail -20 "$OUT/profile.log" >&2; }
tail -5 "$OUT/profile.log"
fi

if want 8; then
step "8. benchmark: Llama-3-8B shapes, random bf16 weights on the device; Ferry, then HF transformers (sdpa)"
timeout 180 "$FERRY_BIN" bench engine --device cuda --model synthetic:llama3-8b --prompt-len 2048 --gen 64 --repeats 3 --batch 32 \
    >"$OUT/bench-ferry.json" 2>"$OUT/bench-ferry.log" || { fail "ferry bench engine"; tail -20 "$OUT/bench-ferry.log" >&2; }
cat "$OUT/bench-ferry.json"
# The same with cuBLAS for the decode matmuls (the GEMV kernel off), to compare.
FERRY_CUDA_GEMV=off timeout 180 "$FERRY_BIN" bench engine --device cuda --model synthetic:llama3-8b --prompt-len 2048 --gen 64 --repeats 3 --batch 32 \
    >"$OUT/bench-ferry-cublas.json" 2>"$OUT/bench-ferry-cublas.log" || { fail "ferry bench engine (FERRY_CUDA_GEMV=off)"; tail -20 "$OUT/bench-ferry-cublas.log" >&2; }
cat "$OUT/bench-ferry-cublas.json"
PYTHONUNBUFFERED=1 timeout 180 python3 scripts/bench_hf_gpu.py --model llama3-8b --prompt-len 2048 --gen 64 --repeats 3 --batch 32 \
    >"$OUT/bench-hf.json" 2>"$OUT/bench-hf.log" || { fail "HF transformers benchmark"; tail -20 "$OUT/bench-hf.log" >&2; }
cat "$OUT/bench-hf.json"
fi

if want 9; then
step "9. speculation's ceiling on the GPU: bench spec-rows, Llama-3-8B shapes, 512 tokens, batch 1, 8 and 32"
for b in 1 8 32; do
    timeout 150 "$FERRY_BIN" bench spec-rows --device cuda --model synthetic:llama3-8b --batch "$b" --context 512 --rows 2,4,8 --rounds 8 \
        >"$OUT/spec-rows-b$b.json" 2>"$OUT/spec-rows-b$b.log" || { fail "ferry bench spec-rows --batch $b"; tail -20 "$OUT/spec-rows-b$b.log" >&2; }
    cat "$OUT/spec-rows-b$b.json"
done
fi

if want 10; then
step "10. KV dtypes on the GPU: bench kv-decode, Llama-3-1B shapes, f32 / f16 / bf16 / int8, batch 8"
timeout 180 "$FERRY_BIN" bench kv-decode --device cuda --model synthetic:llama3-1b --dtypes f32,f16,bf16,int8 --contexts 1024,4096 --batch 8 --rounds 5 --steps 8 \
    >"$OUT/kv-decode.json" 2>"$OUT/kv-decode.log" || { fail "ferry bench kv-decode"; tail -20 "$OUT/kv-decode.log" >&2; }
cat "$OUT/kv-decode.json"
fi

if want 11; then
step "11. decode attention split over the SMs or not: bench kv-decode, Llama-3-8B shapes, f16 KV, batch 1 and 8"
for round in 1 2; do
    for split in off auto; do
        for b in 1 8; do
            name="split-$split-b$b-$round"
            FERRY_CUDA_ATTENTION_SPLIT="$split" timeout 120 "$FERRY_BIN" bench kv-decode --device cuda --model synthetic:llama3-8b \
                --dtypes f16 --contexts 2048,8000 --batch "$b" --rounds 3 --steps 8 \
                >"$OUT/$name.json" 2>"$OUT/$name.log" || { fail "ferry bench kv-decode ($name)"; tail -20 "$OUT/$name.log" >&2; }
            echo "$name: $(python3 -c 'import json,sys; print(" ".join("ctx %d: %.2f ms" % (p["context"], p["step_ms"]) for p in json.load(open(sys.argv[1]))["points"]))' "$OUT/$name.json" 2>/dev/null)"
        done
    done
done
fi

if want 12; then
step "12. where a step's GPU time goes: FERRY_CUDA_PROFILE=1, Llama-3-8B shapes"
FERRY_CUDA_PROFILE=1 timeout 180 "$FERRY_BIN" bench engine --device cuda --model synthetic:llama3-8b --prompt-len 2048 --gen 32 --repeats 1 --batch 32 \
    >"$OUT/profile-engine.json" 2>"$OUT/profile-engine.log" || { fail "ferry bench engine (profiled)"; tail -20 "$OUT/profile-engine.log" >&2; }
sed -n '/^cuda profile/,$p' "$OUT/profile-engine.log"
for split in auto off; do
    FERRY_CUDA_PROFILE=1 FERRY_CUDA_ATTENTION_SPLIT="$split" timeout 120 "$FERRY_BIN" bench kv-decode --device cuda --model synthetic:llama3-8b \
        --dtypes f16 --contexts 8000 --batch 1 --rounds 2 --steps 8 \
        >"$OUT/profile-split-$split.json" 2>"$OUT/profile-split-$split.log" || { fail "ferry bench kv-decode (profiled, split $split)"; tail -20 "$OUT/profile-split-$split.log" >&2; }
    echo "split $split:"
    sed -n '/^cuda profile/,$p' "$OUT/profile-split-$split.log"
done
fi

echo
echo "[$((SECONDS - T0)) s in all]"
[ "$failed" -eq 0 ] && echo "gpu check passed" || echo "gpu check FAILED (logs in $OUT)"
exit "$failed"
