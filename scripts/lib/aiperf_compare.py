#!/usr/bin/env python3
"""The side-by-side table of scripts/bench_aiperf_compare.sh: for each round, `ferry bench
serve`'s figures (its --out JSON) and aiperf's (profile_export_aiperf.json) for the same
configuration on the same cluster. Usage: aiperf_compare.py OUT_DIR"""
import glob
import json
import os
import sys


def ferry_row(path):
    d = json.load(open(path))
    r = d["runs"][0]
    n = r["completed"]
    prompt = [s["prompt_tokens"] for s in r["samples"] if s["ok"]]
    return {
        "requests": f'{n}/{r["requests"]}',
        "ttft_p50": r["ttft_ms"]["p50"], "ttft_p99": r["ttft_ms"]["p99"],
        "itl_p50": r["tpot_ms"]["p50"], "itl_p99": r["tpot_ms"]["p99"],
        "e2e_p50": r["e2e_ms"]["p50"],
        "req_s": r["throughput_rps"], "tok_s": r["output_tok_per_s"],
        "isl": sum(prompt) / max(len(prompt), 1), "osl": r["output_tokens_mean"],
        "cached": r.get("cached_tokens", 0),
    }


def aiperf_row(path):
    d = json.load(open(path))
    g = lambda k, q="avg": (d.get(k) or {}).get(q)  # noqa: E731
    return {
        "requests": f'{int(g("request_count") or 0)}/{int(g("request_count") or 0) + int(g("error_request_count") or 0)}',
        "ttft_p50": g("time_to_first_token", "p50"), "ttft_p99": g("time_to_first_token", "p99"),
        "itl_p50": g("inter_token_latency", "p50"), "itl_p99": g("inter_token_latency", "p99"),
        "e2e_p50": g("request_latency", "p50"),
        "req_s": g("request_throughput"), "tok_s": g("output_token_throughput"),
        "isl": g("usage_prompt_tokens") or g("input_sequence_length"), "osl": g("output_sequence_length"),
        "cached": g("total_usage_prompt_cache_read_tokens"),
    }


def fmt(x, p=1):
    return "-" if x is None else f"{x:.{p}f}"


def main():
    out = sys.argv[1]
    print("| round | client | completed | TTFT p50 / p99 (ms) | ITL (TPOT) p50 / p99 (ms) | E2E p50 (ms) | req/s | output tok/s | prompt tokens (server) | output tokens | prompt tokens from cache | client's own time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rounds = sorted(int(p.split(".")[-2]) for p in glob.glob(os.path.join(out, "ferry.*.json")))
    for k in rounds:
        rows = [("ferry bench serve", ferry_row(os.path.join(out, f"ferry.{k}.json")))]
        ap = os.path.join(out, f"aiperf.{k}", "profile_export_aiperf.json")
        if os.path.exists(ap):
            rows.append(("aiperf 0.13.0", aiperf_row(ap)))
        for (name, r), client in zip(rows, ("ferry", "aiperf")):
            cpu = os.path.join(out, f"{client}.{k}.cpu")
            r["cpu"] = open(cpu).read().strip() if os.path.exists(cpu) else "-"
            print(f'| {k} | {name} | {r["requests"]} | {fmt(r["ttft_p50"], 0)} / {fmt(r["ttft_p99"], 0)} | {fmt(r["itl_p50"])} / {fmt(r["itl_p99"])} | '
                  f'{fmt(r["e2e_p50"], 0)} | {fmt(r["req_s"], 3)} | {fmt(r["tok_s"])} | {fmt(r["isl"])} | {fmt(r["osl"])} | {fmt(r["cached"], 0)} | {r["cpu"]} |')


if __name__ == "__main__":
    main()
