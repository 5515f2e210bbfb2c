#!/bin/bash
# /tmp/ferry-gemvN: `cargo build -p ferry` (dev profile) with GEMV_MAX_ROWS = N in
# crates/ferry-engine/src/backend/cpu/matmul.rs, the binary copied there.
# Paired A/B: decode step time at batches 8..32 with the GEMV path up to 8 rows (A) or 32 rows (B).
mkdir -p /tmp/gemv
ARGS="--model default --prompt-lens 16,32,64 --prompts 1 --batches 4,8,10,12,16,20,24,32 --contexts 64,384 --repeats 1 --steps 4 --passes 1"
for i in 1 2 3; do
  for th in 1 2; do
    pin=""; [ $th = 1 ] && pin="taskset -c 0"
    for v in 8 32; do
      s=$(date +%s)
      $pin /tmp/ferry-gemv$v profile $ARGS --threads $th --out /tmp/gemv/g$v-t$th-$i.json >/dev/null 2>&1 || echo FAIL
      echo "g$v t$th #$i $(( $(date +%s)-s ))s"
    done
  done
done
