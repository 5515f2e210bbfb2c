#!/usr/bin/env python3
"""Issue #19's autoscaling measurement: a load step against `ferry up --autoscale`.

A cluster starts at 1 prefill + 1 decode worker; `ferry bench serve` offers a low rate, then a
high one (the step up), then nothing (the step down). Every second the pools are read with
`ferry pool list`. Reported: when each worker was asked for and became ready, SLO attainment of
the requests that arrived after the last added worker was ready (the target: >= 90%), requests
that failed anywhere (the target: none), and whether the pools came back down. A plot (SVG) shows
the ready workers and every request's TTFT and TPOT against time.

The workers emulate the device of a `ferry profile` file (`--emulate-profile`: each engine step
lasts what the profile's cost model says) while computing a small model, so that more workers
than this machine has cores behave like that many profiled devices; the autoscaler plans over the
same profile. What is measured is the control loop (detection, planning, start-up, routing to
the new workers, draining), not the profile's accuracy (`scripts/validate_plan.sh` measures that).
With `--emulate SLOWER.json` the workers emulate another device than the profiled one (a machine
slower than when it was profiled): the autoscaler then plans at the speed the workers measure
against the profile, or, with `--uncalibrated`, at the profile's.

Usage: scripts/autoscale_step.py --profile PROFILE.json [--out DIR] (build first: cargo build -p ferry)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="the profile the autoscaler plans over (and the workers emulate, unless --emulate)")
    ap.add_argument("--emulate", help="the profile the workers emulate instead: a device other than the profiled one")
    ap.add_argument("--uncalibrated", action="store_true", help="the autoscaler plans at the profile's speed (--autoscale-uncalibrated)")
    ap.add_argument("--out", default=os.path.join(ROOT, "target/autoscale-step"))
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target/debug/ferry"))
    ap.add_argument("--model", default=os.path.join(ROOT, "tests/fixtures/golden/llama-gqa"))
    ap.add_argument("--low-rate", type=float, default=0.1)
    ap.add_argument("--low-requests", type=int, default=8)
    ap.add_argument("--high-rate", type=float, default=0.6)
    ap.add_argument("--high-requests", type=int, default=120)
    ap.add_argument("--prompt-len", default="32..384")
    ap.add_argument("--output-len", default="32..96")
    ap.add_argument("--slo-ttft-ms", type=float, default=8000)
    ap.add_argument("--slo-tpot-ms", type=float, default=150)
    ap.add_argument("--interval-ms", type=int, default=10000)
    ap.add_argument("--max-workers", type=int, default=6)
    ap.add_argument("--settle-s", type=float, default=240, help="longest wait for the pools to shrink after the load")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    slo = ["--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]
    up_log = open(os.path.join(a.out, "up.log"), "w")
    up = subprocess.Popen(
        [a.ferry, "up", "--model", a.model, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1",
         "--prefill", "1", "--decode", "1", "--no-prefix-cache", "--emulate-profile", a.emulate or a.profile,
         "--autoscale", "--autoscale-profile", a.profile, "--autoscale-interval-ms", str(a.interval_ms),
         "--autoscale-max-workers", str(a.max_workers), "--autoscale-up-cooldown-ms", str(a.interval_ms),
         "--autoscale-down-cooldown-ms", str(3 * a.interval_ms), "--autoscale-down-after", "3", *slo,
         *(["--autoscale-uncalibrated"] if a.uncalibrated else [])],
        stdout=up_log, stderr=subprocess.STDOUT)
    try:
        router = wait_ready(up, os.path.join(a.out, "up.log"))
        print(f"cluster ready, router {router}", file=sys.stderr)
        pools, stop = [], threading.Event()
        poller = threading.Thread(target=poll, args=(a.ferry, router, pools, stop), daemon=True)
        poller.start()
        phases = {}
        for name, rate, n in [("low", a.low_rate, a.low_requests), ("high", a.high_rate, a.high_requests)]:
            out = os.path.join(a.out, f"{name}.json")
            print(f"== {name}: {n} requests at {rate}/s", file=sys.stderr)
            subprocess.run([a.ferry, "bench", "serve", "--router", router, "--requests", str(n), "--rates", str(rate),
                            "--prompt-len", a.prompt_len, "--output-len", a.output_len, "--seed", "11", "--label", name,
                            "--out", out, *slo], check=True)
            phases[name] = json.load(open(out))["runs"][0]
        load_end = time.time()
        print("== no load: waiting for the pools to shrink", file=sys.stderr)
        while time.time() - load_end < a.settle_s:
            if pools and pools[-1]["ready"] == (1, 1) and not pools[-1]["draining"]:
                break
            time.sleep(1)
        time.sleep(2)
        stop.set()
        poller.join()
    finally:
        up.terminate()
        up.wait(timeout=60)
    report(a, phases, pools, load_end)


def wait_ready(up, log):
    for _ in range(600):
        m = re.search(r"ready router=([0-9.:]+)", open(log).read())
        if m:
            return m.group(1)
        if up.poll() is not None:
            sys.exit(f"ferry up exited: see {log}")
        time.sleep(0.2)
    sys.exit(f"the cluster did not start: see {log}")


def poll(ferry, router, pools, stop):
    """Every second: the ready (prefill, decode) workers and how many others are listed."""
    while not stop.is_set():
        t = time.time()
        r = subprocess.run([ferry, "pool", "list", "--router", router, "--json"], capture_output=True, text=True)
        if r.returncode == 0:
            ws = json.loads(r.stdout)
            ws = ws.get("workers", ws) if isinstance(ws, dict) else ws
            count = lambda role, state: sum(1 for w in ws if role in str(w.get("role", "")).lower() and state in str(w.get("state", "")).lower())
            pools.append({"t": t, "ready": (count("prefill", "ready"), count("decode", "ready")),
                          "draining": sum(1 for w in ws if "drain" in str(w.get("state", "")).lower()), "listed": len(ws)})
        stop.wait(1.0)


def report(a, phases, pools, load_end):
    reqs = []
    for name, run in phases.items():
        for s in run["samples"]:
            reqs.append({**s, "phase": name, "t": run["started_unix_s"] + s["at_s"]})
    t0 = min(r["t"] for r in reqs)
    high_start = phases["high"]["started_unix_s"]
    # The last change of the ready pools while the high load ran: from then on the cluster was
    # what the autoscaler made of it.
    during = [p for p in pools if high_start <= p["t"] <= load_end]
    peak = max((p["ready"][0] + p["ready"][1] for p in during), default=2)
    settled = next((p["t"] for p in during if p["ready"][0] + p["ready"][1] == peak), high_start)
    split = next((p["ready"] for p in during if p["t"] >= settled), (1, 1))
    meets = lambda r: r["ok"] and r["ttft_ms"] is not None and r["ttft_ms"] <= a.slo_ttft_ms and (r["tpot_ms"] or 0) <= a.slo_tpot_ms
    after = [r for r in reqs if r["phase"] == "high" and r["t"] >= settled]
    before = [r for r in reqs if r["phase"] == "high" and r["t"] < settled]
    frac = lambda rs: sum(map(meets, rs)) / len(rs) if rs else float("nan")
    moves, last = [], None
    for p in pools:
        if p["ready"] != last:
            moves.append({"at_s": round(p["t"] - t0, 1), "ready": p["ready"]})
            last = p["ready"]
    end = pools[-1]["ready"] if pools else None
    result = {
        "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms}, "profile": a.profile, "emulated": a.emulate or a.profile, "calibrated": not a.uncalibrated,
        "load": {"low": [a.low_rate, a.low_requests], "high": [a.high_rate, a.high_requests], "prompt_len": a.prompt_len, "output_len": a.output_len},
        "pools_over_time": moves,
        "high_load_from_s": round(high_start - t0, 1), "load_end_s": round(load_end - t0, 1),
        "scaled_to": split, "last_worker_ready_s": round(settled - t0, 1),
        "attainment_low": frac([r for r in reqs if r["phase"] == "low"]),
        "attainment_high_before_ready": frac(before), "requests_before_ready": len(before),
        "attainment_after_ready": frac(after), "requests_after_ready": len(after),
        "failed": sum(1 for r in reqs if not r["ok"]), "requests": len(reqs),
        "pools_at_end": end,
    }
    json.dump({**result, "requests_detail": reqs, "pools_raw": pools}, open(os.path.join(a.out, "autoscale-step.json"), "w"), indent=1)
    print(json.dumps(result, indent=1))
    svg(os.path.join(a.out, "autoscale-step.svg"), reqs, pools, t0, a)


def svg(path, reqs, pools, t0, a):
    """Ready workers (steps) and each request's TTFT / TPOT as a fraction of its SLO, over time."""
    W, H, L, B = 760, 360, 50, 40
    span = max([p["t"] for p in pools] + [r["t"] + r["e2e_ms"] / 1e3 for r in reqs]) - t0
    x = lambda t: L + (t - t0) / span * (W - L - 20)
    top = 2.0
    y = lambda f: H - B - min(f, top) / top * (H - B - 20)
    yw = lambda n: H - B - n / 8 * (H - B - 20)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{y(1)}" x2="{W - 20}" y2="{y(1)}" stroke="#999" stroke-dasharray="4 3"/>',
           f'<text x="{W - 20}" y="{y(1) - 4}" text-anchor="end" fill="#666">SLO</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(W + L) / 2}" y="{H - 8}" text-anchor="middle">seconds ({a.low_rate}/s, then {a.high_rate}/s, then none)</text>',
           f'<text x="12" y="{(H - B) / 2}" transform="rotate(-90 12 {(H - B) / 2})" text-anchor="middle">latency / SLO (dots), ready workers (line, /8)</text>']
    for s in range(0, int(span) + 1, 60):
        out.append(f'<text x="{x(t0 + s)}" y="{H - B + 14}" text-anchor="middle">{s}</text>')
    pts = " ".join(f"{x(p['t']):.1f},{yw(sum(p['ready'])):.1f}" for p in pools)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#2a6" stroke-width="2"/>')
    for r in reqs:
        if not r["ok"]:
            out.append(f'<text x="{x(r["t"])}" y="{y(top)}" fill="red">x</text>')
            continue
        out.append(f'<circle cx="{x(r["t"]):.1f}" cy="{y(r["ttft_ms"] / a.slo_ttft_ms):.1f}" r="2.5" fill="#36c"/>')
        out.append(f'<circle cx="{x(r["t"]):.1f}" cy="{y((r["tpot_ms"] or 0) / a.slo_tpot_ms):.1f}" r="2.5" fill="#e80"/>')
    out.append(f'<text x="{L + 8}" y="16" fill="#36c">TTFT</text><text x="{L + 48}" y="16" fill="#e80">TPOT</text><text x="{L + 88}" y="16" fill="#2a6">ready workers</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out))


if __name__ == "__main__":
    main()
