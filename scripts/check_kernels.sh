#!/usr/bin/env bash
# Compile every CUDA kernel (kernels/*.cu) without a GPU, through the same Rust code path the CUDA
# backend uses at run time (ferry-engine's `nvrtc` module over cudarc, NVRTC loaded with dlopen),
# for a virtual architecture (compute_90 by default), then assemble each PTX for the matching real
# architecture with ptxas and report registers, spills and shared memory per kernel.
#
# Fails on any NVRTC or ptxas error, on a kernel missing from the PTX, and on any register spill.
#
# Tools, installed under target/cuda-tools/ on first use (pinned wheels from PyPI, no driver needed):
# - nvidia-cuda-nvrtc-cu12: libnvrtc.so.12 (+ builtins), found by cudarc through LD_LIBRARY_PATH
# - nvidia-cuda-runtime-cu12: the CUDA headers (cuda_fp16.h, cuda_bf16.h, ...), the include path
# - nvidia-cuda-nvcc-cu12: ptxas
#
# Environment: FERRY_KERNEL_ARCH (default 90) picks compute_XX / sm_XX.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

ARCH="${FERRY_KERNEL_ARCH:-90}"
TOOLS="target/cuda-tools"
VENV="$TOOLS/venv"
PINS=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86)
STAMP="$VENV/ferry-pins"

mkdir -p "$TOOLS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "${PINS[*]}" ]; then
    echo "installing ${PINS[*]} into $VENV" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"
    echo "${PINS[*]}" >"$STAMP"
fi

NV="$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0] + "/x"))')"
NVRTC_LIB="$NV/cuda_nvrtc/lib"
INCLUDE="$NV/cuda_runtime/include"
PTXAS="$NV/cuda_nvcc/bin/ptxas"
for f in "$NVRTC_LIB/libnvrtc.so.12" "$INCLUDE/cuda_runtime.h" "$INCLUDE/cuda_fp16.h" "$INCLUDE/cuda_bf16.h" "$PTXAS"; do
    if [ ! -e "$f" ]; then
        echo "error: $f is missing from the installed wheels (delete $VENV to reinstall)" >&2
        exit 1
    fi
done
echo "ptxas: $("$PTXAS" --version | tail -1)"

PTX_DIR="$PWD/$TOOLS/ptx-compute_$ARCH"  # absolute: the test runs in its crate directory
rm -rf "$PTX_DIR"
mkdir -p "$PTX_DIR"

echo "== NVRTC: kernels/*.cu -> PTX (compute_$ARCH), via ferry-engine --features cuda"
LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
FERRY_CUDA_INCLUDE="$INCLUDE" \
FERRY_KERNEL_ARCH="compute_$ARCH" \
FERRY_KERNEL_PTX_DIR="$PTX_DIR" \
    cargo test -p ferry-engine --features cuda --test kernel_compile -- --ignored --nocapture

shopt -s nullglob
ptx_files=("$PTX_DIR"/*.ptx)
if [ "${#ptx_files[@]}" -eq 0 ]; then
    echo "error: no PTX was written to $PTX_DIR" >&2
    exit 1
fi

echo "== ptxas -arch=sm_$ARCH"
failed=0
table="$TOOLS/kernels-sm_$ARCH.txt"
printf '%-30s %-16s %9s %12s %12s %10s\n' kernel file registers spill_stores spill_loads smem_bytes >"$table"
for ptx in "${ptx_files[@]}"; do
    file="$(basename "$ptx" .ptx).cu"
    log="${ptx%.ptx}.ptxas.log"
    if ! "$PTXAS" -arch="sm_$ARCH" -v "$ptx" -o "${ptx%.ptx}.cubin" >"$log" 2>&1; then
        cat "$log" >&2
        echo "FAIL $file: ptxas failed" >&2
        failed=1
        continue
    fi
    # ptxas -v prints, per function: "Function properties for NAME", then
    # "N bytes stack frame, S bytes spill stores, L bytes spill loads", then
    # "Used R registers, ..., M bytes smem, ...".
    awk -v file="$file" '
        /Function properties for / { name = $NF; next }
        /bytes spill stores/ { for (i = 1; i <= NF; i++) { if ($(i+1) == "bytes" && $(i+2) == "spill" && $(i+3) == "stores,") st = $i; if ($(i+1) == "bytes" && $(i+2) == "spill" && $(i+3) == "loads") ld = $i } next }
        /Used [0-9]+ registers/ {
            regs = 0; smem = 0
            for (i = 1; i <= NF; i++) { if ($i == "Used") regs = $(i+1); if ($(i+1) == "bytes" && $(i+2) ~ /^smem/) smem = $i }
            printf "%-30s %-16s %9s %12s %12s %10s\n", name, file, regs, st + 0, ld + 0, smem
        }' "$log" >>"$table"
done
cat "$table"

kernels="$(tail -n +2 "$table" | wc -l)"
spills="$(tail -n +2 "$table" | awk '$4 != 0 || $5 != 0' | wc -l)"
if [ "$spills" -ne 0 ]; then
    echo "FAIL: $spills kernel(s) spill registers (see the table above)" >&2
    failed=1
fi
if [ "$failed" -ne 0 ]; then
    echo "error: kernel check failed (PTX and ptxas logs in $PTX_DIR)" >&2
    exit 1
fi
echo "all $kernels kernels in ${#ptx_files[@]} files compile for sm_$ARCH without spills"
