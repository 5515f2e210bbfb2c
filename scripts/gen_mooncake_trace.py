#!/usr/bin/env python3
"""Write a small trace in the Mooncake format (FAST '25; github.com/kvcache-ai/Mooncake,
FAST25-release/traces): JSON lines {"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}, each hash id one block of 512 prompt tokens, the last one partial.

The shape follows the Mooncake conversation trace: a few shared system prompts (2-3 blocks), and
conversations on them, each turn repeating the earlier turns' full blocks and adding 1-2 blocks of
its own and a partial last block. As in the real traces, a partial last block gets an id of its
own (its hash covers different content from any full block), so no id is shared between a partial
and a full block. Deterministic: the same arguments give the same file.

    python3 scripts/gen_mooncake_trace.py --requests 32 --seed 1 > tests/fixtures/traces/mooncake_small.jsonl
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--systems", type=int, default=3, help="shared system prompts")
    ap.add_argument("--mean-gap-ms", type=float, default=1000.0, help="mean time between arrivals (exponential)")
    ap.add_argument("--max-blocks", type=int, default=9, help="longest prompt, in 512-token blocks")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    next_id = 0

    def fresh(n):
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(rng.randint(2, 3)) for _ in range(a.systems)]
    conversations = []  # each: the full blocks sent so far
    t = 0.0
    for _ in range(a.requests):
        t += rng.expovariate(1.0 / a.mean_gap_ms)
        live = [c for c in conversations if len(c) + 3 <= a.max_blocks]
        if live and rng.random() < 0.6:
            conv = rng.choice(live)
        else:
            conv = list(rng.choice(systems))
            conversations.append(conv)
        conv.extend(fresh(rng.randint(1, 2)))
        tail = rng.randint(64, 511)
        hash_ids = conv + fresh(1)
        print(json.dumps({
            "timestamp": int(t),
            "input_length": 512 * (len(hash_ids) - 1) + tail,
            "output_length": rng.randint(16, 256),
            "hash_ids": hash_ids,
        }))


if __name__ == "__main__":
    main()
