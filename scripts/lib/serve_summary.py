"""Summarize `ferry bench serve` results of several configurations run in rounds.

Usage: python3 scripts/lib/serve_summary.py OUT_DIR WORKLOAD...
Reads OUT_DIR/WORKLOAD-CONFIG.ROUND.json and prints, per workload, rate and configuration, the
median over rounds of TPOT p50 and output tokens/s (each round's in brackets) and the distinct
outputs digests (one digest: the configurations answered alike).
"""
import glob
import json
import statistics
import sys

out, workloads = sys.argv[1], sys.argv[2:]
for wl in workloads:
    rows = {}
    for f in sorted(glob.glob(f"{out}/{wl}-*.json")):
        name = f.split("/")[-1][len(wl) + 1:].rsplit(".", 2)[0]
        for r in json.load(open(f))["runs"]:
            rows.setdefault((r["rate"], name), []).append(r)
    for (rate, name), rs in sorted(rows.items()):
        tpot = [round(r["tpot_ms"]["p50"], 2) for r in rs]
        tps = [round(r["output_tok_per_s"], 1) for r in rs]
        digests = sorted({r["outputs_digest"] for r in rs})
        print(f"{wl:6} rate {rate:4} {name:7} TPOT p50 median {statistics.median(tpot):7.2f} ms {tpot}"
              f"  output median {statistics.median(tps):7.1f} tok/s {tps}  digests {digests}")
