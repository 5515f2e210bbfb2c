#!/usr/bin/env python3
"""How steady is this machine's compute? One process pinned to each core times a fixed piece of
interpreter work (integer arithmetic in registers, no memory traffic to speak of, nothing of
Ferry's) over and over, and the medians per window are drawn against time, one line per core.

If the lines move together by more than the 15% `ferry plan`'s validation allows, no profile
taken before a measurement can predict that measurement's speed (docs/benchmarks.md, issue #19).

Usage: scripts/speed_probe.py [--seconds 240] [--window 20] [--out DIR]
       scripts/speed_probe.py --plot DIR/speed-probe.json   (redraw from a saved run)
Writes DIR/speed-probe.json (every sample) and DIR/speed-probe.svg. Stops by itself.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORK = 2_000_000


def work():
    x = 0
    for i in range(WORK):
        x = (x * 31 + i) & 0xFFFF
    return x


def child(seconds):
    end = time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        work()
        print(f"{time.time():.3f} {(time.perf_counter() - t) * 1000:.2f}", flush=True)


def windows(samples, t0, window):
    by = {}
    for t, ms in samples:
        by.setdefault(int((t - t0) // window), []).append(ms)
    return [(k * window, statistics.median(v)) for k, v in sorted(by.items())]


def svg(path, run):
    W, H, L, R, T, B = 720, 300, 60, 20, 30, 40
    t0, window = run["t0"], run["window_s"]
    lines = {core: windows(s, t0, window) for core, s in run["samples"].items()}
    xmax = max(x for ws in lines.values() for x, _ in ws) + window
    ys = [y for ws in lines.values() for _, y in ws]
    lo, hi = min(ys) * 0.9, max(ys) * 1.1
    X = lambda x: L + (W - L - R) * (x + window / 2) / xmax
    Y = lambda y: H - B - (H - T - B) * (y - lo) / (hi - lo)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="18" font-size="13">Fixed work per sample, median per {window:g} s window, one process pinned to each core ({run["started"]})</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W) / 2}" y="{H - 8}" text-anchor="middle">seconds</text>',
           f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" text-anchor="middle">ms per sample</text>']
    for i in range(6):
        y = lo + (hi - lo) * i / 5
        out.append(f'<text x="{L - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:.0f}</text>')
    for x in range(0, int(xmax) + 1, max(int(window) * 3, 1)):
        out.append(f'<text x="{X(x) - X(0) + L:.1f}" y="{H - B + 14}" text-anchor="middle">{x}</text>')
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for n, (core, ws) in enumerate(sorted(lines.items())):
        c = colors[n % len(colors)]
        pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in ws)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - R - 60}" y="{T + 14 * (n + 1)}" fill="{c}">core {core}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def summary(run):
    for core, s in sorted(run["samples"].items()):
        ws = [y for _, y in windows(s, run["t0"], run["window_s"])]
        print(f"core {core}: {len(s)} samples; window medians {min(ws):.0f}-{max(ws):.0f} ms ({max(ws) / min(ws):.2f}x): "
              + " ".join(f"{y:.0f}" for y in ws))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--window", type=float, default=20)
    ap.add_argument("--out", default="target/speed-probe")
    ap.add_argument("--plot", help="redraw the SVG of a saved speed-probe.json")
    ap.add_argument("--child", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child)
    if a.plot:
        with open(a.plot) as f:
            run = json.load(f)
        svg(os.path.join(os.path.dirname(a.plot), "speed-probe.svg"), run)
        return summary(run)
    os.makedirs(a.out, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.time()
    procs = {c: subprocess.Popen(["taskset", "-c", str(c), sys.executable, __file__, "--child", str(a.seconds)], stdout=subprocess.PIPE, text=True) for c in cores}
    print(f"probing {len(cores)} cores for {a.seconds:g} s", file=sys.stderr)
    samples = {}
    for c, p in procs.items():
        out, _ = p.communicate()
        samples[str(c)] = [tuple(map(float, l.split())) for l in out.splitlines() if l.strip()]
    run = {"started": started, "t0": t0, "window_s": a.window, "work_iterations": WORK, "samples": samples}
    path = os.path.join(a.out, "speed-probe.json")
    with open(path, "w") as f:
        json.dump(run, f)
    svg(os.path.join(a.out, "speed-probe.svg"), run)
    summary(run)
    print(f"results in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
