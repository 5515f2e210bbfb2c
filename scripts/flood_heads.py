#!/usr/bin/env python3
"""Slowloris against a running Ferry router's HTTP API, with a normal client beside it.

Opens N connections that each send half a request head and then nothing (as fast as the machine
allows), while a normal client sends one short chat request every 0.5 s. Prints, every second and
at the end: connections opened, closed by the router (without an answer), the normal requests'
status and latency, and the router's connection metrics. Loopback only; stops by itself.

    ferry up --listen 127.0.0.1:0 --model PATH --api-key-file ... (prints its HTTP and metrics ports)
    python3 scripts/flood_heads.py --http 127.0.0.1:PORT --metrics 127.0.0.1:PORT -n 19000

The process needs a descriptor limit above N (`ulimit -n`).
"""
import argparse
import asyncio
import json
import time
import urllib.request


async def half_head(host, port, closed_after, opened):
    try:
        r, w = await asyncio.open_connection(host, port)
    except OSError:
        closed_after.append(0.0)
        return
    opened.append(1)
    t0 = time.monotonic()
    try:
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        await w.drain()
        await r.read()  # EOF or reset: the router closed it
    except OSError:
        pass
    closed_after.append(time.monotonic() - t0)
    w.close()


def normal(http, model, key):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://{http}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    if key:
        req.add_header("authorization", f"Bearer {key}")
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:
        status = f"failed ({type(e).__name__})"
    return status, time.monotonic() - t0


def metrics(addr):
    try:
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("ferry_router_connections_") and 'server="router_http"' in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("ferry_router_connections_")] = float(value)
    return out


async def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("-n", type=int, default=19000)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--seconds", type=float, default=25.0)
    a = ap.parse_args()
    host, port = a.http.rsplit(":", 1)
    closed_after, opened, normals = [], [], []
    loop = asyncio.get_running_loop()
    before = metrics(a.metrics)
    t0 = time.monotonic()

    async def flood():
        tasks = []
        for _ in range(a.n):
            tasks.append(asyncio.create_task(half_head(host, int(port), closed_after, opened)))
            if len(tasks) % 200 == 0:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    async def client():
        while time.monotonic() - t0 < a.seconds:
            status, took = await loop.run_in_executor(None, normal, a.http, a.model, a.api_key)
            normals.append((round(time.monotonic() - t0, 1), status, round(took * 1000)))
            await asyncio.sleep(0.5)

    async def progress():
        while time.monotonic() - t0 < a.seconds:
            await asyncio.sleep(1)
            m = metrics(a.metrics)
            last = normals[-1] if normals else None
            print(f"t={time.monotonic() - t0:5.1f}s opened={len(opened)} closed={len(closed_after)} open_now={m.get('open')} last_normal={last}", flush=True)

    f = asyncio.create_task(flood())
    await asyncio.gather(client(), progress())
    f.cancel()
    after = metrics(a.metrics)
    ok = [n for n in normals if n[1] == 200]
    print(json.dumps({
        "half_sent_connections": a.n,
        "opened": len(opened),
        "closed_by_router": len(closed_after),
        "closed_within_1s": sum(1 for c in closed_after if c < 1.0),
        "normal_requests": len(normals),
        "normal_served": len(ok),
        "normal_latency_ms_median": sorted(n[2] for n in ok)[len(ok) // 2] if ok else None,
        "normal_latency_ms_max": max((n[2] for n in ok), default=None),
        "normal_not_served": [n for n in normals if n[1] != 200],
        "evicted": after.get("evicted_total", 0) - before.get("evicted_total", 0),
        "refused": after.get("refused_total", 0) - before.get("refused_total", 0),
        "timed_out": after.get("timed_out_total", 0) - before.get("timed_out_total", 0),
    }, indent=1))


asyncio.run(main())
