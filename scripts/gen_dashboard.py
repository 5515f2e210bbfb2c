#!/usr/bin/env python3
"""Ferry's Grafana dashboard, as code: prints (or writes, or checks) the dashboard JSON that the
kustomize base ships as a ConfigMap for a Grafana sidecar (deploy/k8s/base/dashboards/ferry.json).

  python3 scripts/gen_dashboard.py --write   regenerate the committed file
  python3 scripts/gen_dashboard.py --check   fail when the committed file differs from this
  python3 scripts/gen_dashboard.py --exprs   print every panel query, one JSON object a line
                                             (scripts/check_observability.py evaluates them)

Every query reads the metric names of docs/operations.md ("Metrics"); the panels are the ones an
operator of a disaggregated cluster asks for: request rate and goodput against the SLOs, TTFT and
TPOT percentiles, queue depth, KV pool use per worker, prefix-cache hit rate, KV transfer time,
the prefill:decode load balance, migrations and errors. No dependencies beyond Python 3.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "deploy", "k8s", "base", "dashboards", "ferry.json")

DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"


def quantiles(metric, qs=(0.5, 0.9, 0.99)):
    """histogram_quantile targets of a histogram summed over every series, one per quantile."""
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RI}])))", f"p{round(q * 100):g}")
            for q in qs]


class Board:
    def __init__(self):
        self.panels = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title):
        self._newline()
        self.panels.append({
            "type": "row", "title": title, "id": self._id(), "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
        })
        self.y += 1

    def panel(self, title, description, targets, unit="short", kind="timeseries", w=8, h=8,
              thresholds=None, stack=False, max_=None):
        if self.x + w > 24:
            self._newline()
        p = {
            "type": kind,
            "title": title,
            "description": description,
            "id": self._id(),
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [
                {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i),
                 "range": kind == "timeseries", "instant": kind == "stat"}
                for i, (expr, legend) in enumerate(targets)
            ],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {},
        }
        if max_ is not None:
            p["fieldConfig"]["defaults"]["max"] = max_
            p["fieldConfig"]["defaults"]["min"] = 0
        if kind == "timeseries":
            p["fieldConfig"]["defaults"]["custom"] = {
                "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if stack else 0,
                "stacking": {"mode": "normal" if stack else "none"}, "showPoints": "never",
            }
            p["options"] = {"legend": {"displayMode": "list", "placement": "bottom"},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
        else:
            p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "values": False},
                            "colorMode": "value", "graphMode": "area"}
        if thresholds:
            p["fieldConfig"]["defaults"]["thresholds"] = {
                "mode": "absolute",
                "steps": [{"color": c, "value": v} for v, c in thresholds],
            }
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self):
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self):
        i = self.next_id
        self.next_id += 1
        return i


def dashboard():
    b = Board()
    ok = 'ferry_router_requests_total{outcome="ok"}'

    b.row("Service level")
    b.panel("Requests by outcome", "Requests the routers ended per second, by outcome (ok, cancelled, invalid, "
            "exhausted = refused for room, unavailable, error).",
            [(f"sum by (outcome) (rate(ferry_router_requests_total[{RI}]))", "{{outcome}}")], unit="reqps", stack=True)
    b.panel("Goodput against the SLOs", "Requests per second that finished within both the TTFT and the TPOT "
            "SLO (the routers' --slo-ttft-ms / --slo-tpot-ms), beside all that finished ok.",
            [(f"sum(rate(ferry_router_goodput_requests_total[{RI}]))", "within both SLOs"),
             (f"sum(rate({ok}[{RI}]))", "finished ok")], unit="reqps")
    b.panel("SLO attainment", "Share of the requests that finished ok over the last 5 minutes that met both "
            "SLOs (goodput / ok).",
            [("sum(rate(ferry_router_goodput_requests_total[5m])) / sum(rate(" + ok + "[5m]))", "attainment")],
            unit="percentunit", kind="stat", w=4, max_=1,
            thresholds=[(None, "red"), (0.9, "orange"), (0.99, "green")])
    b.panel("In flight", "Requests the routers are serving now, queued ones included.",
            [("sum(ferry_router_inflight_requests)", "in flight")], kind="stat", w=4)
    b.panel("Prompt and generated tokens", "Tokens per second: prompt tokens by where they were served "
            "(computed, or from a prefix cache) and tokens generated.",
            [(f"sum by (served) (rate(ferry_router_prompt_tokens_total[{RI}]))", "prompt ({{served}})"),
             (f"sum(rate(ferry_router_generation_tokens_total[{RI}]))", "generated")], unit="short", w=12)
    b.panel("Prompt and output lengths", "Median prompt and output tokens per request.",
            [("histogram_quantile(0.5, sum by (le) (rate(ferry_router_request_prompt_tokens_bucket[" + RI + "])))", "prompt p50"),
             ("histogram_quantile(0.5, sum by (le) (rate(ferry_router_request_generation_tokens_bucket[" + RI + "])))", "output p50")],
            w=12)

    b.row("Latency")
    b.panel("Time to first token", "TTFT percentiles (arrival at the router to the first token sent) and the "
            "SLO the routers hold them to.",
            quantiles("ferry_router_time_to_first_token_seconds")
            + [("max(ferry_router_slo_time_to_first_token_seconds)", "SLO")], unit="s")
    b.panel("Time per output token", "TPOT percentiles per finished choice ((last token - first token) / "
            "(tokens - 1)) and the SLO.",
            quantiles("ferry_router_request_time_per_output_token_seconds")
            + [("max(ferry_router_slo_time_per_output_token_seconds)", "SLO")], unit="s")
    b.panel("Inter-token latency", "Gaps between consecutive tokens sent to clients.",
            quantiles("ferry_router_inter_token_latency_seconds", (0.5, 0.99)), unit="s")
    b.panel("End-to-end latency", "Arrival to the final message, per finished choice.",
            quantiles("ferry_router_e2e_request_latency_seconds", (0.5, 0.99)), unit="s")
    b.panel("Queue time", "Time waiting in the routers' admission queue for KV room (p50, p99), and in the "
            "prefill workers' queues.",
            quantiles("ferry_router_request_queue_time_seconds", (0.5, 0.99))
            + [(f"histogram_quantile(0.99, sum by (le) (rate(ferry_worker_request_queue_time_seconds_bucket{{role=\"prefill\"}}[{RI}])))",
                "prefill worker p99")], unit="s")
    b.panel("Router overhead", "Per finished choice, time not spent waiting on workers (the router's own cost).",
            quantiles("ferry_router_overhead_seconds", (0.5, 0.99)), unit="s")

    b.row("Pools and load")
    b.panel("Workers", "Registered workers by role and state.",
            [("sum by (role, state) (ferry_router_workers)", "{{role}} {{state}}")], stack=True)
    b.panel("Queue depth", "Requests waiting: in the routers' admission queue (for decode KV room) and on the workers.",
            [("sum(ferry_router_queue_depth)", "router admission queue"),
             ("sum by (role) (ferry_worker_queue_depth)", "{{role}} workers")])
    b.panel("Prefill:decode balance", "How loaded each pool is: the prefill pool's estimated queue (seconds of "
            "queued prompt tokens at each worker's rate, mean over workers) against the decode pool's KV use "
            "(mean share of blocks used or promised). One pool far ahead of the other means the split is off.",
            [("avg(ferry_router_worker_estimated_queue_seconds{role=\"prefill\"})", "prefill queue (s)"),
             ("avg(1 - ferry_router_worker_kv_blocks_free{role=\"decode\"} / ferry_router_worker_kv_blocks_capacity{role=\"decode\"})",
              "decode KV use")])
    b.panel("Prefill queue per worker", "Prompt tokens ahead of a new prompt on each prefill worker.",
            [("sum by (worker) (ferry_router_worker_queued_prefill_tokens{role=\"prefill\"})", "{{worker}}")])
    b.panel("Requests per worker", "Requests the router has on each worker.",
            [("sum by (worker, role) (ferry_router_worker_inflight_requests)", "{{worker}} ({{role}})")])
    b.panel("Engine step time", "p50 and p99 of one engine step (the batch's forward pass), by role.",
            [(f"histogram_quantile(0.5, sum by (le, role) (rate(ferry_worker_step_seconds_bucket[{RI}])))", "p50 {{role}}"),
             (f"histogram_quantile(0.99, sum by (le, role) (rate(ferry_worker_step_seconds_bucket[{RI}])))", "p99 {{role}}")],
            unit="s")

    b.row("KV cache")
    b.panel("KV pool use per worker", "Share of each decode (or colocated) worker's KV blocks used or promised, "
            "as the router sees it.",
            [("1 - sum by (worker) (ferry_router_worker_kv_blocks_free) / sum by (worker) (ferry_router_worker_kv_blocks_capacity)",
              "{{worker}}")], unit="percentunit", max_=1)
    b.panel("Prefix cache hit rate", "Share of prompt tokens served from a prefix cache instead of computed.",
            [(f"sum(rate(ferry_router_prompt_tokens_total{{served=\"cache\"}}[{RI}])) / sum(rate(ferry_router_prompt_tokens_total[{RI}]))",
              "hit rate")], unit="percentunit", max_=1)
    b.panel("KV transfer time", "Prefill to decode KV transfer duration per request (p50, p99).",
            quantiles("ferry_router_kv_transfer_seconds", (0.5, 0.99)), unit="s")
    b.panel("KV bytes moved", "KV bytes per second moved prefill to decode, by the transport used.",
            [(f"sum by (transport) (rate(ferry_router_kv_bytes_total[{RI}]))", "{{transport}}")], unit="Bps")
    b.panel("KV transfers by transport", "Transfers per second by the transport the router chose for the pair "
            "and the one used: chosen and used differ when a transfer fell back (e.g. cuda_ipc -> tcp).",
            [(f"sum by (chosen, used) (rate(ferry_router_kv_transfers_total[{RI}]))", "{{chosen}} -> {{used}}")],
            unit="ops")
    b.panel("Prefix cache evictions", "Cached blocks evicted per second, by worker role.",
            [(f"sum by (role) (rate(ferry_worker_prefix_cache_evictions_total[{RI}]))", "{{role}}")], unit="ops")

    b.row("KV disk tier")
    b.panel("Prefix blocks by tier", "KV blocks the routers' prefix index has on each worker, in its pool and in "
            "its disk tier (workers run with --kv-disk).",
            [("max by (worker, tier) (ferry_router_kv_indexed_blocks)", "{{worker}} {{tier}}")])
    b.panel("Prompt tokens read from disk", "Prompt tokens per second a worker read from its disk tier instead "
            "of computing them (they count in the prefix cache hit rate too).",
            [(f"sum by (role, instance) (rate(ferry_worker_kv_disk_hit_tokens_total[{RI}]))", "{{role}} {{instance}}")])
    b.panel("Disk tier use", "Bytes of block files on each worker's disk tier against its --kv-disk-bytes.",
            [("sum by (instance) (ferry_worker_kv_disk_bytes) / sum by (instance) (ferry_worker_kv_disk_capacity_bytes)",
              "{{instance}}")], unit="percentunit", max_=1)
    b.panel("Disk reads and writes", "Bytes per second written to and read from the disk tiers, and the "
            "measured read rate the routers price a disk hit at.",
            [(f"sum by (instance) (rate(ferry_worker_kv_disk_written_bytes_total[{RI}]))", "written {{instance}}"),
             (f"sum by (instance) (rate(ferry_worker_kv_disk_read_bytes_total[{RI}]))", "read {{instance}}")],
            unit="Bps")
    b.panel("Disk writer queue and losses", "Blocks waiting for the writer; blocks dropped because it was "
            "behind, files found damaged (each a miss, never served) and blocks evicted from disk, per second.",
            [("sum by (instance) (ferry_worker_kv_disk_write_queue_blocks)", "queued {{instance}}"),
             (f"sum(rate(ferry_worker_kv_disk_write_dropped_total[{RI}]))", "dropped"),
             (f"sum(rate(ferry_worker_kv_disk_corrupt_total[{RI}]))", "damaged"),
             (f"sum(rate(ferry_worker_kv_disk_evictions_total[{RI}]))", "evicted")])
    b.panel("Disk read rate", "Prompt tokens of KV per second a disk read delivers, as each worker measured "
            "it (0 until its first read).",
            [("max by (instance) (ferry_worker_kv_disk_read_tokens_per_second)", "{{instance}}")])

    b.row("Faults")
    b.panel("Errors", "Requests per second that ended in something other than ok, by outcome.",
            [(f"sum by (outcome) (rate(ferry_router_requests_total{{outcome!=\"ok\"}}[{RI}]))", "{{outcome}}")],
            unit="reqps")
    b.panel("Migrations and retries", "Requests moved to another worker mid-stream, and started again "
            "elsewhere before their first token.",
            [(f"sum(rate(ferry_router_migrations_total[{RI}]))", "migrations"),
             (f"sum(rate(ferry_router_retries_total[{RI}]))", "retries")], unit="ops")
    b.panel("Workers declared dead", "Workers the routers declared dead, by cause, over 5 minutes.",
            [("sum by (cause) (increase(ferry_router_workers_marked_dead_total[5m]))", "{{cause}}")])
    b.panel("Admission refusals", "Requests refused by the routers' admission queue (full or timed out).",
            [(f"sum by (reason) (rate(ferry_router_queue_rejected_total[{RI}]))", "{{reason}}")], unit="reqps")
    b.panel("Authentication failures", "Callers refused for a missing or wrong key, token or secret.",
            [(f"sum by (api) (rate(ferry_router_auth_failures_total[{RI}]))", "router {{api}}"),
             (f"sum by (port) (rate(ferry_worker_auth_failures_total[{RI}]))", "worker {{port}}")], unit="reqps")
    b.panel("Engine failures", "Failed steps re-run sequence by sequence, and sequences ended alone by a failure.",
            [(f"sum(rate(ferry_worker_step_isolations_total[{RI}]))", "step isolations"),
             (f"sum(rate(ferry_worker_sequence_failures_total[{RI}]))", "sequence failures")], unit="ops")

    b.row("Speculative decoding")
    b.panel("Acceptance", "Share of proposed speculative tokens accepted (decode and colocated workers).",
            [(f"sum(rate(ferry_worker_spec_accepted_tokens_total[{RI}])) / sum(rate(ferry_worker_spec_proposed_tokens_total[{RI}]))",
              "accepted / proposed")], unit="percentunit", max_=1)
    b.panel("Tokens per verify step", "Tokens emitted per verifying step (1 = no gain).",
            [(f"sum(rate(ferry_worker_spec_emitted_tokens_total[{RI}])) / sum(rate(ferry_worker_spec_verify_steps_total[{RI}]))",
              "tokens / step")])
    b.panel("Speculation's cost", "What speculating costs the decoding workers: rows verified and rejected per token "
            "they decoded, and the time spent speculating outside the forward pass over the time in steps.",
            [(f"(sum(rate(ferry_worker_spec_proposed_tokens_total[{RI}])) - sum(rate(ferry_worker_spec_accepted_tokens_total[{RI}])))"
              f" / sum(rate(ferry_worker_generation_tokens_total{{role=~\"decode|colocated\"}}[{RI}]))", "rejected rows / token"),
             (f"sum(rate(ferry_worker_spec_seconds_sum[{RI}])) / sum(rate(ferry_worker_step_seconds_sum{{role=~\"decode|colocated\"}}[{RI}]))",
              "speculating / step time")], unit="percentunit")

    return {
        "title": "Ferry",
        "uid": "ferry-overview",
        "description": "Ferry: a disaggregated LLM serving cluster (routers, prefill and decode pools).",
        "tags": ["ferry", "llm", "serving"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{
            "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1,
        }]},
        "annotations": {"list": []},
        "panels": b.panels,
    }


def render():
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


def main(argv):
    mode = argv[1] if len(argv) > 1 else "--print"
    text = render()
    if mode == "--write":
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "w") as f:
            f.write(text)
    elif mode == "--check":
        with open(OUT) as f:
            if f.read() != text:
                print(f"error: {os.path.relpath(OUT)} is not what scripts/gen_dashboard.py makes; "
                      "run it with --write", file=sys.stderr)
                return 1
        print(f"ok   {os.path.relpath(OUT)} is what scripts/gen_dashboard.py makes")
    elif mode == "--exprs":
        for p in dashboard()["panels"]:
            for t in p.get("targets", []):
                print(json.dumps({"panel": p["title"], "legend": t["legendFormat"], "expr": t["expr"]}))
    elif mode == "--print":
        sys.stdout.write(text)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
