#!/bin/bash
# /tmp/ferry-gemvN: `cargo build -p ferry` (dev profile) with GEMV_MAX_ROWS = N in
# crates/ferry-engine/src/backend/cpu/matmul.rs, the binary copied there.
# Paired A/B: decode steps with the row-dot path up to 8 rows (before) and 12 (after);
# batches 13 and 16 take the same GEMM path in both binaries: the noise control.
mkdir -p /tmp/gemv2
ARGS="--model default --prompt-lens 16,32,64 --prompts 1 --batches 8,10,12,13,16 --contexts 64,384 --repeats 1 --steps 4 --passes 1"
for i in 1 2 3; do
  for th in 1 2; do
    pin=""; [ $th = 1 ] && pin="taskset -c 0"
    order="8 12"; [ $((i % 2)) = 0 ] && order="12 8"
    for v in $order; do
      $pin /tmp/ferry-gemv$v profile $ARGS --threads $th --out /tmp/gemv2/g$v-t$th-$i.json >/dev/null 2>&1 || echo FAIL
      echo "g$v t$th #$i $(date +%T)"
    done
  done
done
