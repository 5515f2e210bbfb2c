#!/usr/bin/env python3
"""Check Ferry's observability artefacts against a live cluster and a real Prometheus.

  python3 scripts/check_observability.py [--ferry target/debug/ferry] [--model PATH]
                                         [--out target/observability] [--plot FILE.png] [--rounds N]

1. The dashboard (deploy/k8s/base/dashboards/ferry.json) is what scripts/gen_dashboard.py makes.
2. The alerting rules (deploy/k8s/components/monitoring/prometheus-rule.yaml): `promtool check
   rules` on its spec, and its unit tests (ferry-rules.test.yaml) through `promtool test rules`.
3. A live cluster: `ferry up` (one prefill, one decode worker with speculative decoding, SLOs set)
   on loopback, and a Prometheus server (Debian's `prometheus`) scraping the router and both
   workers every second. After some traffic (streamed chat completions, repeated prompts for the
   prefix cache, one malformed request):
   - `promtool check metrics` on every component's /metrics is clean (its output is kept in OUT);
   - every metric name a panel or a rule reads is exported by some component;
   - every panel query evaluates in Prometheus to at least one finite value, and every rule's
     expression evaluates without error.
   With --plot, each panel's series over the run are drawn into one PNG (matplotlib, installed into
   a virtual environment under target/ on first use): a preview of the dashboard's data, not a
   Grafana screenshot.

Needs `prometheus` and `promtool` on PATH (Debian package `prometheus`). Talks only to loopback;
stops everything it started. Exits non-zero on any failed check.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MONITORING = os.path.join(ROOT, "deploy", "k8s", "components", "monitoring")
RATE_INTERVAL = "5m"  # covers the whole run: every rate() sees all of its traffic
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "max", "min", "avg", "and", "or",
    "unless", "on", "ignoring", "le", "without", "count", "up", "absent", "vector", "bool",
}

failures = []


def fail(what):
    failures.append(what)
    print(f"FAIL {what}", flush=True)


def ok(what):
    print(f"ok   {what}", flush=True)


def need_yaml():
    try:
        import yaml  # noqa: F401
        return
    except ImportError:
        pass
    venv = os.path.join(ROOT, "target", "observability-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pyyaml==6.0.2"], check=True)
    os.execv(py, [py] + sys.argv)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, data=None, headers=None, timeout=30):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.headers.get("content-type", ""), r.read()


def metric_names(expr):
    """The metric names an expression reads (identifiers that are not PromQL words, labels or
    recording rules)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if w in PROMQL_WORDS or ":" in w or w.startswith("__"):
            continue
        names.add(re.sub(r"_(bucket|sum|count)$", "", w) if w.startswith("ferry_") else w)
    return names


def check_dashboard_file():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_dashboard.py"), "--check"],
                       capture_output=True, text=True)
    if r.returncode:
        fail(f"the committed dashboard differs from scripts/gen_dashboard.py's: {r.stderr.strip()}")
    else:
        ok("the committed dashboard is scripts/gen_dashboard.py's")


def load_rules(out):
    import yaml
    with open(os.path.join(MONITORING, "prometheus-rule.yaml")) as f:
        spec = yaml.safe_load(f)["spec"]
    path = os.path.join(out, "ferry-rules.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"groups": spec["groups"]}, f, sort_keys=False)
    shutil.copy(os.path.join(MONITORING, "ferry-rules.test.yaml"), out)
    for cmd, what in ((["promtool", "check", "rules", "ferry-rules.yaml"], "promtool check rules"),
                      (["promtool", "test", "rules", "ferry-rules.test.yaml"], "promtool test rules (the alerts' unit tests)")):
        r = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
        if r.returncode:
            fail(f"{what}:\n{r.stdout}{r.stderr}")
        else:
            ok(what)
    return [(g["name"], r.get("alert") or r.get("record"), r["expr"]) for g in spec["groups"] for r in g["rules"]]


def panel_queries():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_dashboard.py"), "--exprs"],
                       capture_output=True, text=True, check=True)
    return [json.loads(line) for line in r.stdout.splitlines()]


class Cluster:
    """`ferry up` on loopback; its components' addresses from the lines it prints."""

    def __init__(self, ferry, model, out):
        self.log = open(os.path.join(out, "ferry-up.log"), "w")
        args = [ferry, "up", "--model", model, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                "--prefill", "1", "--decode", "1", "--speculate", "ngram",
                "--kv-disk", os.path.join(out, "kv-disk"),
                "--slo-ttft-ms", "2000", "--slo-tpot-ms", "200", "--ready-timeout", "180"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        self.metrics = {}  # component -> host:port
        self.http = None
        deadline = time.time() + 240
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            if line.startswith("router ") and "metrics" in f:
                self.metrics["router"] = f["metrics"]
                self.http = f.get("http")
            elif line.startswith("worker ") and "metrics" in f:
                self.metrics[f["role"]] = f["metrics"]
            elif line.startswith("ready "):
                self.model = f["model"]
                break
            if time.time() > deadline:
                break
        if not self.http or set(self.metrics) != {"router", "prefill", "decode"}:
            self.stop()
            raise SystemExit(f"ferry up did not start (see {self.log.name}): {self.metrics}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.write(line)

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Prometheus:
    def __init__(self, targets, out):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = os.path.join(out, "prometheus.yml")
        with open(cfg, "w") as f:
            json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                       "scrape_configs": [{"job_name": "ferry", "static_configs": [
                           {"targets": [addr], "labels": {"component": name}} for name, addr in targets.items()]}]}, f)
        self.data = tempfile.mkdtemp(prefix="prom-", dir=out)
        self.log = open(os.path.join(out, "prometheus.log"), "w")
        self.proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={self.data}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if http(self.url + "/-/ready", timeout=2)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        raise SystemExit(f"prometheus did not start (see {self.log.name})")

    def query(self, expr, at=None):
        q = {"query": expr}
        if at is not None:
            q["time"] = f"{at:.3f}"
        _, _, body = http(self.url + "/api/v1/query?" + urllib.parse.urlencode(q))
        return json.loads(body)

    def query_range(self, expr, start, end, step):
        q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        _, _, body = http(self.url + "/api/v1/query_range?" + q)
        return json.loads(body)

    def targets_up(self):
        _, _, body = http(self.url + "/api/v1/targets")
        return [t["health"] for t in json.loads(body)["data"]["activeTargets"]]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def traffic(base, model, rounds):
    """Streamed chat completions, two at a time: varied prompts, repeated ones (prefix-cache hits),
    and one malformed request (an error outcome). Returns how many failed."""
    words = ("river stone cloud maple lantern harbor violet ember canyon meadow orbit saffron glacier "
             "thimble quartz willow falcon prairie cobalt juniper").split()

    def long(r, k):
        # ~200 new tokens: past the routers' --local-prefill-max, so a prefill worker computes it
        # and ships its KV (the transfer panels need transfers all through the run).
        return f"Round {r}, text {k}. Summarize: " + " ".join(words[(k * 7 + j * 13 + r) % len(words)] for j in range(160))

    prompts = []
    for r in range(rounds):
        fresh = [f"Round {r}. Write a short list of {n} fruits, one per line." for n in range(3, 9)]
        prompts += [long(r, 0)] + fresh[:3] + [long(r, 1)] + fresh[3:] + fresh[:3] + [long(r, 2)]
        prompts += ["Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3] * 2

    def one(p):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": p}],
                           "max_tokens": 24, "temperature": 0, "stream": True}).encode()
        try:
            http(base + "/v1/chat/completions", body, {"content-type": "application/json"}, timeout=120)
        except (urllib.error.URLError, OSError) as e:
            failed.append(f"{p[:30]}...: {e}")

    failed = []
    threads = []
    for p in prompts:
        t = threading.Thread(target=one, args=(p,))
        t.start()
        threads.append(t)
        if len(threads) >= 2:
            threads.pop(0).join()
    for t in threads:
        t.join()
    try:
        http(base + "/v1/chat/completions", b'{"model": "' + model.encode() + b'", "messages": 7}',
             {"content-type": "application/json"})
        failed.append("a malformed request was answered 200")
    except urllib.error.HTTPError as e:
        if e.code != 400:
            failed.append(f"a malformed request was answered {e.code}, not 400")
    return failed


def finite_values(result):
    data = result.get("data", {})
    if data.get("resultType") == "scalar":
        vals = [data["result"][1]]
    else:
        vals = [s["value"][1] for s in data.get("result", [])]
    return [float(v) for v in vals if not math.isnan(float(v))]


def check_live(ferry, model, out, plot, rules, panels, rounds):
    cluster = Cluster(ferry, model, out)
    prom = None
    try:
        prom = Prometheus(cluster.metrics, out)
        deadline = time.time() + 30
        while prom.targets_up().count("up") < len(cluster.metrics) and time.time() < deadline:
            time.sleep(0.5)
        start = time.time()
        for f in traffic(f"http://{cluster.http}", cluster.model, rounds):
            fail(f"traffic: {f}")
        time.sleep(4)  # a few more scrapes after the last request

        # promtool check metrics, and the exported names.
        exported = set()
        for name, addr in cluster.metrics.items():
            _, ctype, body = http(f"http://{addr}/metrics")
            text = body.decode()
            with open(os.path.join(out, f"metrics-{name}.txt"), "w") as f:
                f.write(text)
            exported |= set(re.findall(r"^# TYPE (\S+)", text, re.M))
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            with open(os.path.join(out, f"promtool-{name}.txt"), "w") as f:
                f.write(f"$ curl -s http://{addr}/metrics | promtool check metrics\n{r.stdout}{r.stderr}exit={r.returncode}\n")
            if r.returncode or r.stdout.strip() or r.stderr.strip():
                fail(f"promtool check metrics on the {name}'s /metrics:\n{r.stdout}{r.stderr}")
            else:
                ok(f"promtool check metrics: the {name}'s /metrics is clean ({len(re.findall('^# TYPE', text, re.M))} families, {ctype})")
        health = prom.targets_up()
        if health.count("up") != len(cluster.metrics):
            fail(f"prometheus scraped {health}")

        # Every name a panel or a rule reads is exported.
        wanted = {}
        for p in panels:
            for n in metric_names(p["expr"]):
                wanted.setdefault(n, f"panel {p['panel']!r}")
        for _, name, expr in rules:
            for n in metric_names(expr):
                if n != "up":
                    wanted.setdefault(n, f"rule {name}")
        missing = sorted(f"{n} ({where})" for n, where in wanted.items() if n not in exported)
        if missing:
            fail("read but not exported: " + ", ".join(missing))
        else:
            ok(f"all {len(wanted)} metric names the dashboard and the rules read are exported")

        # Every panel query has a finite value; every rule evaluates.
        for p in panels:
            expr = p["expr"].replace("$__rate_interval", RATE_INTERVAL)
            res = prom.query(expr)
            vals = finite_values(res) if res.get("status") == "success" else []
            if not vals:
                fail(f"panel {p['panel']!r} ({p['legend']}): {expr} -> {json.dumps(res)[:300]}")
        ok_panels = len(panels) - sum(1 for f in failures if f.startswith("panel "))
        print(f"     {ok_panels} of {len(panels)} panel queries gave values", flush=True)
        for group, name, expr in rules:
            res = prom.query(expr)
            if res.get("status") != "success":
                fail(f"rule {group}/{name} does not evaluate: {json.dumps(res)[:300]}")
        ok(f"all {len(rules)} rule expressions evaluate")
        if plot:
            draw(prom, panels, start, time.time(), plot)
    finally:
        if prom:
            prom.stop()
        cluster.stop()


def draw(prom, panels, start, end, path):
    venv = os.path.join(ROOT, "target", "observability-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode:
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "matplotlib==3.9.2"], check=True)
    series = []
    for p in panels:
        expr = p["expr"].replace("$__rate_interval", "30s")
        res = prom.query_range(expr, start, end, 2)
        for s in res.get("data", {}).get("result", []):
            label = p["legend"]
            for k, v in s["metric"].items():
                label = label.replace("{{" + k + "}}", v)
            series.append({"panel": p["panel"], "label": label,
                           "t": [float(t) - start for t, _ in s["values"]], "v": [float(v) for _, v in s["values"]]})
    data = os.path.join(os.path.dirname(path) or ".", "panels.json")
    with open(data, "w") as f:
        json.dump(series, f)
    code = r'''
import json, sys, math
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
series = json.load(open(sys.argv[1]))
titles = list(dict.fromkeys(s["panel"] for s in series))
cols = 5
rows = math.ceil(len(titles) / cols)
fig, axes = plt.subplots(rows, cols, figsize=(cols * 4, rows * 2.6))
for ax, title in zip(axes.flat, titles):
    for s in series:
        if s["panel"] == title:
            ax.plot(s["t"], s["v"], label=s["label"][:28], lw=1)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper left")
for ax in list(axes.flat)[len(titles):]:
    ax.axis("off")
fig.suptitle("Ferry dashboard queries over a live run (Prometheus data; x: seconds)", fontsize=11)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=70)
'''
    subprocess.run([py, "-c", code, data, path], check=True)
    ok(f"plotted {len(series)} series into {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", default=os.path.join(ROOT, "target", "debug", "ferry"))
    ap.add_argument("--model", default=os.environ.get("FERRY_SMOLLM2_GGUF", "default"))
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "observability"))
    ap.add_argument("--plot", help="draw the panels' series into this PNG")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of traffic (14 requests each; more for a longer plot)")
    a = ap.parse_args()
    need_yaml()
    for tool in ("prometheus", "promtool"):
        if not shutil.which(tool):
            raise SystemExit(f"error: {tool} is not on PATH (Debian: apt-get install prometheus)")
    os.makedirs(a.out, exist_ok=True)
    check_dashboard_file()
    rules = load_rules(a.out)
    panels = panel_queries()
    check_live(a.ferry, a.model, a.out, a.plot, rules, panels, a.rounds)
    if failures:
        print(f"{len(failures)} check(s) failed; logs in {a.out}", file=sys.stderr)
        return 1
    print(f"all observability checks passed; logs in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
