"""NVIDIA's `aiperf profile` (pinned from PyPI) against a running `ferry up`.

Run with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1; aiperf takes the host)
  aiperf                     the aiperf executable (default: `aiperf` beside this Python)
  tokenizer                  a local HF tokenizer folder for aiperf's synthetic prompts (default:
                             tests/fixtures/golden/llama-bf16; aiperf loads a named or "builtin"
                             tokenizer from the network, and with HF_HUB_OFFLINE=1 it refuses local
                             paths, so this runs without it)
  requests, concurrency      default 8 and 2
  isl, osl, min_tokens       synthetic input tokens, max_completion_tokens, and the vLLM `min_tokens`
                             sent through --extra-inputs (default 32, 32, 16)
  timeout                    seconds for the whole run (default 600)
  artifact_dir               where aiperf writes its exports (default: a new temp folder)
aiperf streams chat completions with --use-server-token-count --per-chunk-usage (so Ferry's
`stream_options.continuous_usage_stats` usage is what it counts), then this reads its JSON exports:
the run completed, every request was sent and answered, no errors, the payloads held min_tokens and
continuous usage, and every answer has at least min_tokens and at most osl tokens by the server's
count, and every streamed chunk carried usage (raw export). Prints one line per check; any failure raises (non-zero exit).
"""

import json
import os
import subprocess
import sys
import tempfile
import urllib.parse

from openai_check import check

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    a = json.loads(sys.argv[1])
    n, conc = a.get("requests", 8), a.get("concurrency", 2)
    isl, osl, min_tokens = a.get("isl", 32), a.get("osl", 32), a.get("min_tokens", 16)
    aiperf = a.get("aiperf") or os.path.join(os.path.dirname(sys.executable), "aiperf")
    tokenizer = a.get("tokenizer") or os.path.join(HERE, "fixtures/golden/llama-bf16")
    u = urllib.parse.urlsplit(a["base_url"])
    url = f"{u.scheme}://{u.netloc}"
    out = a.get("artifact_dir") or tempfile.mkdtemp(prefix="ferry-aiperf-")
    cmd = [
        aiperf, "profile",
        "--model", a["model"],
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", tokenizer,
        "--extra-inputs", f"min_tokens:{min_tokens}",
        "--use-server-token-count",
        "--per-chunk-usage",
        "--request-count", str(n),
        "--concurrency", str(conc),
        "--isl", str(isl), "--isl-stddev", "0",
        "--osl", str(osl),
        "--random-seed", "7",
        "--ui", "none",
        "--artifact-dir", out,
        "--export-level", "raw",
    ]  # fmt: skip
    if a.get("api_key"):
        cmd += ["--api-key", a["api_key"]]
    print("running:", " ".join(cmd), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.get("timeout", 600), env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"aiperf profile ran past {e.timeout}s:\n{(e.stdout or b'')[-4000:]}")
    log = p.stdout + p.stderr
    check("aiperf profile exits 0", p.returncode == 0, log[-6000:])

    path = os.path.join(out, "profile_export_aiperf.json")
    check("aiperf wrote its JSON export", os.path.exists(path), os.listdir(out))
    d = json.load(open(path))
    print(f"aiperf {d.get('aiperf_version')}", flush=True)
    stat = lambda k: (d.get(k) or {}).get("avg")  # noqa: E731
    check("aiperf run complete, not cancelled", d.get("is_complete") is True and d.get("was_cancelled") is False, (d.get("is_complete"), d.get("was_cancelled")))
    check("aiperf error_summary is empty", d.get("error_summary") == [], d.get("error_summary"))
    check("aiperf request_error_rate is 0", stat("request_error_rate") == 0, d.get("request_error_rate"))
    check(f"aiperf request_count is {n}", stat("request_count") == n, d.get("request_count"))
    check(f"aiperf completed_request_count is {n}", stat("completed_request_count") == n, d.get("completed_request_count"))
    check("aiperf counted the server's usage", stat("total_usage_completion_tokens") is not None and stat("total_usage_prompt_tokens") is not None, {k: d.get(k) for k in ("total_usage_completion_tokens", "total_usage_prompt_tokens")})

    records = [json.loads(line) for line in open(os.path.join(out, "profile_export.jsonl")) if line.strip()]
    check(f"aiperf recorded {n} requests", len(records) == n, len(records))
    check("no record holds an error", all("error" not in r and not r.get("metadata", {}).get("was_cancelled") for r in records), [r for r in records if "error" in r][:2])
    counts = [r["metrics"].get("usage_completion_tokens", {}).get("value") for r in records]
    check(f"every answer has {min_tokens} to {osl} tokens (server usage)", all(c is not None and min_tokens <= c <= osl for c in counts), counts)
    check("every stream had a first token", all(r["metrics"].get("time_to_first_token", {}).get("value") for r in records), [r["metrics"].get("time_to_first_token") for r in records])

    inputs = json.load(open(os.path.join(out, "inputs.json")))
    payloads = [pl for s in inputs["data"] for pl in s["payloads"]]
    check(
        "the payloads streamed with min_tokens and continuous usage",
        payloads
        and all(
            pl.get("stream") is True
            and pl.get("min_tokens") == min_tokens
            and pl.get("stream_options") == {"include_usage": True, "continuous_usage_stats": True}
            for pl in payloads
        ),
        payloads[:1],
    )

    # --per-chunk-usage: every streamed chunk carried the usage so far (vLLM's continuous_usage_stats).
    raw = [json.loads(line) for line in open(os.path.join(out, "profile_export_raw.jsonl")) if line.strip()]
    bad = []
    for r in raw:
        chunks = [json.loads(pk["value"]) for resp in r.get("responses", []) for pk in resp.get("packets", []) if pk.get("name") == "data" and pk.get("value", "").startswith("{")]
        done = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
        if r.get("status") != 200 or not chunks or len(done) != len(chunks) or done != sorted(done) or done[-1] < min_tokens:
            bad.append((r.get("status"), done, len(chunks)))
    check(f"aiperf's raw export: {n} streams, every chunk with usage, counts growing to the total", len(raw) == n and not bad, bad[:3])
    print(f"aiperf: {n} requests, output tokens {counts}, artifacts in {out}", flush=True)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
