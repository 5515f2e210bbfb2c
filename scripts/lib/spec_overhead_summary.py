"""Summarize scripts/bench_spec_overhead.sh: speculation against off, served side by side.

Usage: python3 scripts/lib/spec_overhead_summary.py OUT_DIR [PLOT.svg]
Reads OUT_DIR/SPEC.ROUND.offCORE.{off,spec}.{json,metrics} and prints, per proposer and rate:
- each request's TPOT with speculation over the same request's TPOT without, served in the same
  seconds on the other core: the median and the geometric mean of these ratios over all rounds
  and both core placements, and each pair-run's ratio of TPOT p50s;
- off's TPOT p50 on each core (how much the cores differ; the swap cancels it);
- per proposer, from the decode workers' /metrics summed over its runs: tokens proposed and
  accepted, verify steps, the time speculating outside the forward pass against the steps' own
  time, and the rows verified and rejected against the tokens decoded;
- the outputs digests (one per rate: both sides answered alike).
With PLOT.svg, every request's ratio is drawn as a dot, one column per proposer and rate, with
the median, the quartiles, no change (1.0) and the issue's 3% bound.
"""
import collections
import glob
import json
import math
import re
import statistics
import sys


def metrics(path):
    """`name value` lines (labels dropped; the decode worker exports one series of each)."""
    out = {}
    for line in open(path):
        m = re.match(r"^([a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def plot(path, ratios):
    """Strip plot of the per-request ratios (SVG, no dependencies)."""
    cols = sorted(ratios)
    lo = min(0.9, min(min(v) for v in ratios.values()))
    hi = max(1.1, max(max(v) for v in ratios.values()))
    w, h, pad, colw = 120 + 150 * len(cols), 360, 60, 150
    y = lambda r: pad + (hi - r) / (hi - lo) * (h - 2 * pad)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="14">TPOT with speculation / without, same request, '
           f'served side by side</text>']
    for r in [lo, 0.95, 1.0, 1.03, 1.05, hi]:
        dash = '' if r == 1.0 else ' stroke-dasharray="4 3"'
        color = "#d62728" if r == 1.03 else "#888"
        svg.append(f'<line x1="{pad}" x2="{w - 20}" y1="{y(r):.1f}" y2="{y(r):.1f}" stroke="{color}"{dash}/>')
        svg.append(f'<text x="{pad - 6}" y="{y(r) + 4:.1f}" text-anchor="end">{r:.2f}</text>')
    svg.append(f'<text x="{w - 22}" y="{y(1.03) - 4:.1f}" text-anchor="end" fill="#d62728">3% bound</text>')
    for i, key in enumerate(cols):
        x0 = pad + 30 + i * colw
        vs = sorted(ratios[key])
        for j, r in enumerate(vs):
            jitter = (j * 37 % 60) - 30
            svg.append(f'<circle cx="{x0 + 45 + jitter}" cy="{y(r):.1f}" r="2.5" fill="#1f77b4" fill-opacity="0.6"/>')
        q1, med, q3 = statistics.quantiles(vs, n=4)
        svg.append(f'<rect x="{x0 + 5}" y="{y(q3):.1f}" width="80" height="{y(q1) - y(q3):.1f}" fill="none" stroke="black"/>')
        svg.append(f'<line x1="{x0 + 5}" x2="{x0 + 85}" y1="{y(med):.1f}" y2="{y(med):.1f}" stroke="black" stroke-width="2"/>')
        svg.append(f'<text x="{x0 + 45}" y="{h - pad + 18}" text-anchor="middle">{key[0]}, {key[1]:g} req/s</text>')
        svg.append(f'<text x="{x0 + 45}" y="{h - pad + 34}" text-anchor="middle">median {med:.3f} (n={len(vs)})</text>')
    svg.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(svg) + "\n")


out = sys.argv[1]
ratios = collections.defaultdict(list)       # (spec, rate) -> per-request ratios
p50s = collections.defaultdict(list)         # (spec, rate) -> pair-run ratios of TPOT p50
off_by_core = collections.defaultdict(list)  # (rate, core) -> off's TPOT p50
digests = collections.defaultdict(set)       # rate -> outputs digests
counters = collections.defaultdict(lambda: collections.Counter())  # (spec, side) -> summed metrics
for f in sorted(glob.glob(f"{out}/*.off.json")):
    stem = f[: -len(".off.json")]
    spec, _round, place = stem.split("/")[-1].split(".")
    core = int(place[len("off"):])
    off_runs = json.load(open(f))["runs"]
    spec_runs = json.load(open(stem + ".spec.json"))["runs"]
    for off, sp in zip(off_runs, spec_runs):
        rate = off["rate"]
        digests[rate] |= {off["outputs_digest"], sp["outputs_digest"]}
        off_by_core[(rate, core)].append(off["tpot_ms"]["p50"])
        p50s[(spec, rate)].append(sp["tpot_ms"]["p50"] / off["tpot_ms"]["p50"])
        for a, b in zip(off["samples"], sp["samples"]):
            if a["ok"] and b["ok"] and a["output_tokens"] > 1:
                ratios[(spec, rate)].append(b["tpot_ms"] / a["tpot_ms"])
    for side in ("off", "spec"):
        counters[(spec, side)].update(metrics(f"{stem}.{side}.metrics"))

for (spec, rate), rs in sorted(ratios.items()):
    gm = math.exp(statistics.fmean(math.log(r) for r in rs))
    q1, _, q3 = statistics.quantiles(rs, n=4)
    pr = sorted(round(r, 3) for r in p50s[(spec, rate)])
    print(f"{spec:6} rate {rate:4}: per request (n={len(rs)}) median {statistics.median(rs):.4f}, geomean {gm:.4f}, "
          f"quartiles {q1:.3f}-{q3:.3f}; TPOT p50 ratio per pair-run {pr}")
for (rate, core), v in sorted(off_by_core.items()):
    print(f"off    rate {rate:4} on core {core}: TPOT p50 {[round(x, 2) for x in v]}")
for (spec, side), c in sorted(counters.items()):
    steps, step_s = c["ferry_worker_step_seconds_count"], c["ferry_worker_step_seconds_sum"]
    spec_s = c.get("ferry_worker_spec_seconds_sum", 0.0)
    proposed, accepted = c.get("ferry_worker_spec_proposed_tokens_total", 0.0), c.get("ferry_worker_spec_accepted_tokens_total", 0.0)
    rejected, tokens = proposed - accepted, c.get("ferry_worker_generation_tokens_total", 0.0)
    print(f"{spec:6} {side:4}: {steps:.0f} steps, {step_s:.2f} s in them; proposed {proposed:.0f}, accepted {accepted:.0f}, "
          f"verify steps {c.get('ferry_worker_spec_verify_steps_total', 0):.0f}; speculating outside the pass {spec_s * 1e3:.1f} ms "
          f"({100 * spec_s / step_s if step_s else 0:.3f}% of the steps' time); rejected rows {rejected:.0f} "
          f"({100 * rejected / tokens if tokens else 0:.3f}% of the {tokens:.0f} tokens decoded)")
for rate, d in sorted(digests.items()):
    print(f"rate {rate}: outputs digests {sorted(d)}")
if len(sys.argv) > 2:
    plot(sys.argv[2], ratios)
    print(f"plot: {sys.argv[2]}")
