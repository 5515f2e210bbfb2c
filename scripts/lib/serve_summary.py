"""Summarize `ferry bench serve` results of several configurations run in rounds.

Usage: python3 scripts/lib/serve_summary.py OUT_DIR WORKLOAD...
Reads OUT_DIR/WORKLOAD-CONFIG.ROUND.json and prints, per workload, rate and configuration, the
median over rounds of TPOT p50, output tokens/s over the run's wall time, and output tokens/s
while decoding (each round's in brackets), and the distinct outputs digests (one digest: the
configurations answered alike).

"While decoding" is the decode worker's own rate: the tokens after each request's first (which
the prefill worker makes) over the time at least one request was between its first and last
token (the union of the requests' [arrival + TTFT, arrival + E2E]). With one prefill worker on
one core, the wall time also holds the seconds the decode worker waits for prompts.
"""
import glob
import json
import statistics
import sys


def decoding_tok_per_s(run):
    """Tokens after the first over the union of the requests' decode intervals."""
    spans = sorted((s["at_s"] + s["ttft_ms"] / 1e3, s["at_s"] + s["e2e_ms"] / 1e3) for s in run["samples"] if s["ok"])
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    tokens = sum(s["output_tokens"] - 1 for s in run["samples"] if s["ok"])
    return tokens / busy if busy > 0 else 0.0


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
        dec = [round(decoding_tok_per_s(r), 1) for r in rs]
        digests = sorted({r["outputs_digest"] for r in rs})
        print(f"{wl:6} rate {rate:4} {name:7} TPOT p50 median {statistics.median(tpot):7.2f} ms {tpot}"
              f"  output median {statistics.median(tps):7.1f} tok/s {tps}"
              f"  while decoding {statistics.median(dec):7.1f} tok/s {dec}  digests {digests}")
